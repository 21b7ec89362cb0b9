"""deepspeed.accelerator on zerort: get_accelerator(), for CPU and CUDA.

    from deepspeed.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name(local_rank))   # 'cuda:1', or 'cpu'
    get_accelerator().memory_allocated()                               # bytes, on either

The accelerator is CUDA when torch sees a GPU, the CPU otherwise (DS_ACCELERATOR=cpu or
=cuda forces one, as in DeepSpeed). On the CPU the memory figures are zerort's counting
allocator's (zerort.accounting.phases), the same one the memory report reads, so they are
real bytes, not zeros. is_fp16_supported() on the CPU is DeepSpeed's answer (whether
oneDNN has fp16 kernels on this CPU), though zerort trains fp16 on any CPU: scripts choose
their precision by it (DeepSpeed's own tests pick fp16 where it says yes, else bf16), and a
bare zero.Init() picks its build dtype by it, so a different answer would train a script
on other numbers than DeepSpeed does, silently.
"""
import os

import torch

from zerort.accounting import phases
from zerort.errors import ConfigError
from zerort.integrations.deepspeed.names import not_provided


def _local_world_size():
    from zerort import comm

    return max(1, comm.detect_launch_env()["local_world_size"])


class _Accelerator:
    """What both kinds share; subclasses name the device and its memory."""
    name = None

    def device_name(self, device_index=None):
        return self.name if device_index is None or self.name == "cpu" else f"{self.name}:{device_index}"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def current_device_name(self):
        return self.device_name(self.current_device())

    def is_bf16_supported(self):
        return True

    def is_fp16_supported(self):
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):  # a torch built without oneDNN
            return False

    def supported_dtypes(self):
        return [t for t, ok in ((torch.float32, True), (torch.bfloat16, self.is_bf16_supported()),
                                (torch.float16, self.is_fp16_supported())) if ok]

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def initial_seed(self):
        return torch.initial_seed()

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def is_pinned(self, tensor):
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def on_accelerator(self, tensor):
        return tensor.device.type == self.name

    def range_push(self, msg):
        return None

    def range_pop(self):
        return None

    def lazy_call(self, callback):
        return callback()

    def is_triton_supported(self):
        return False

    def use_host_timers(self):
        return True

    def resolves_data_dependency(self):
        return False

    def handles_memory_backpressure(self):
        return False


class CpuAccelerator(_Accelerator):
    name = "cpu"

    def is_available(self):
        return True

    def device_count(self):
        return _local_world_size()  # one rank per "device", as DeepSpeed counts CPU ranks

    def current_device(self):
        from zerort import comm

        return comm.detect_launch_env()["local_rank"]

    def set_device(self, device_index):
        return None

    def synchronize(self, device_index=None):
        return None

    def communication_backend_name(self):
        return "gloo"

    def empty_cache(self):
        return None

    def memory_allocated(self, device_index=None):
        return phases.allocated("cpu")[0]

    def max_memory_allocated(self, device_index=None):
        return phases.allocated("cpu")[1]

    def reset_peak_memory_stats(self, device_index=None):
        phases.reset_peak("cpu")

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_reserved(self, device_index=None):
        return self.memory_allocated()

    def max_memory_reserved(self, device_index=None):
        return self.max_memory_allocated()

    def total_memory(self, device_index=None):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class CudaAccelerator(_Accelerator):
    name = "cuda"

    def is_available(self):
        return torch.cuda.is_available()

    def device_count(self):
        return torch.cuda.device_count()

    def current_device(self):
        return torch.cuda.current_device()

    def set_device(self, device_index):
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index=None):
        torch.cuda.synchronize(device_index)

    def communication_backend_name(self):
        return "nccl"

    def is_bf16_supported(self):
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self):
        return torch.cuda.get_device_capability()[0] >= 7

    def manual_seed(self, seed):
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.cuda.manual_seed_all(seed)

    def empty_cache(self):
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None):
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None):
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index=None):
        torch.cuda.reset_peak_memory_stats(device_index)

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_reserved(self, device_index=None):
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None):
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index=None):
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index=None):
        return torch.cuda.mem_get_info(device_index)[0]


KINDS = {"cpu": CpuAccelerator, "cuda": CudaAccelerator}
_chosen = {}


def get_accelerator():
    """The one accelerator of this process (CUDA when torch sees a GPU; DS_ACCELERATOR
    chooses)."""
    if "it" not in _chosen:
        kind = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        if kind not in KINDS:
            raise ConfigError([f"DS_ACCELERATOR={kind!r}: zerort's DeepSpeed drop-in has the accelerators "
                               f"{sorted(KINDS)}; unset it or pick one of them"])
        _chosen["it"] = KINDS[kind]()
    return _chosen["it"]


def set_accelerator(accel):
    _chosen["it"] = accel


def is_current_accelerator_supported():
    return True


__getattr__ = not_provided(__name__)
