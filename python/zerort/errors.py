"""zerort's exception types: one per kind of failure, the same whether Python or C++
raised it. core/error.h declares the C++ side of each; the binding (python/bindings.cpp)
translates a C++ exception into the class of the same name here.

    Error (RuntimeError)                  every failure zerort reports on purpose
    +-- UsageError                        the training loop called zerort in an order it cannot honour
    |   +-- DeviceError (also TypeError)  a tensor or model zerort cannot use as it is (its device, dtype or build)
    |   +-- ModelMismatchError            the ranks were given different models
    +-- ConfigError (also ValueError)     a bad config key or option; .problems: one line per key
    +-- CheckpointError                   a checkpoint that cannot be saved or loaded; names the file or tensor
    +-- NonFiniteError                    non-finite gradients for longer than allowed; .params, .loss_scale
    |   +-- LossScaleError                an fp16 overflow with the loss scale already at its minimum
    +-- CommError                         a communicator cannot be made or used (a backend not in this build)
        +-- CommTimeoutError (also TimeoutError)  a collective did not finish within comm.timeout_s
        +-- CollectiveMismatchError       a checked call (comm.debug, stage 3): ranks called different collectives

This module imports nothing of zerort's, so the binding can load it while zerort is
being imported.
"""


class Error(RuntimeError):
    """Every failure zerort reports on purpose."""


class UsageError(Error):
    """The training loop called zerort in an order it cannot honour."""


class DeviceError(UsageError, TypeError):
    """A tensor or a model on a device zerort cannot use there."""


class ModelMismatchError(UsageError):
    """The ranks were given different models. The message names the first parameter (or
    buffer) that differs and the ranks on each side."""


class ConfigError(Error, ValueError):
    """A bad config. .problems lists one line per bad key."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid zerort config:\n  " + "\n  ".join(self.problems))


class CheckpointError(Error):
    """A checkpoint that cannot be saved or loaded; the message names the file or the
    parameter, and what to do."""


class NonFiniteError(Error):
    """Training produced non-finite gradients for too long. .params: the first parameters
    whose gradients were not finite; .loss_scale: the scale of the last skipped step."""

    def __init__(self, message, params=(), loss_scale=None):
        super().__init__(message)
        self.params = list(params)
        self.loss_scale = loss_scale


class LossScaleError(NonFiniteError):
    """An fp16 overflow with the loss scale already at loss_scale.min_scale."""


class CommError(Error):
    """A communicator that cannot be made or used."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective that did not finish within comm.timeout_s."""


class CollectiveMismatchError(CommError):
    """comm.debug's check: ranks called different collectives (or the same with other arguments)."""
