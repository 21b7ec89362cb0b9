"""zerort configuration: our own keys, or the subset of DeepSpeed's JSON schema we support.

    c = zerort.config.parse({"stage": 2, "precision": "bf16", "optimizer": {"lr": 3e-4}})
    zerort.config.parse("ds_config.json")      # a DeepSpeed config works too
    c.optimizer.lr, c.loss_scale.window        # a frozen Config of sections (zerort.config.sections)
    c.offload.optimizer.device                 # "none", "cpu" or "nvme" (zerort.config.offload)

Every key is typed and range-checked; all problems in one config are reported together in
one ConfigError, each naming the key, the value it got and what is allowed. An unknown key
is named with the closest known one; rules that join keys (fp16 and bf16 both on, a
minimum loss scale above the initial one, a batch size that does not divide) are checked
after every key has been read.

A config is at most MAX_DEPTH levels deep (a deeper one, or one too deep for the JSON
parser, is a ConfigError), and messages show values cut short (show()): a 60 MB value
under an unknown key is named in a line, not repeated. A message names at most MAX_LISTED
unknown keys (the rest are counted), and a config file is a regular file of at most
MAX_FILE_BYTES, read once (read_config_file).

Note [bounded values]: every number has a range the engine can honour. An integer is at
most MAX_INT (2**31 - 1: steps, windows, counts, batch sizes), an element count at most
MAX_NUMEL, stage3.prefetch at most MAX_PREFETCH; an integer literal of any length in a
config file is read (as a LongInteger past MAX_INT_DIGITS digits) and refused by its
key's check. A value the engine computes with in FP32 (the optimizer's lr, betas, eps and
weight decay, clipping, loss scales, the scheduler's numbers) is checked as FP32 holds it
(fp32_problem): one past FP32's largest finite number is inf there, and a nonzero one
below its smallest normal number is 0 or subnormal there (GPU kernels flush subnormals to
0), so eps = 1e-46, a Python float > 0, made the first update 0 / 0 = NaN.
"""
from zerort.config.files import read_config, read_config_file, read_json  # noqa: F401  (the package's API)
from zerort.config.parser import is_deepspeed_form, known_keys, parse  # noqa: F401
from zerort.config.reader import (MAX_AUTOS_LISTED, MAX_DEPTH, MAX_FILE_BYTES, MAX_LISTED, MAX_NUMEL,  # noqa: F401
                                  MAX_PERIOD, MAX_PREFETCH, at_most, fp32_problem, show)
from zerort.config.sections import (Aio, Batch, Comm, Config, LossScale, Monitor, OffloadConfig,  # noqa: F401
                                    OffloadOptimizer, OffloadParam, Optimizer, Stage3, replace, resolve_batch, to_dict)
from zerort.errors import ConfigError  # noqa: F401
