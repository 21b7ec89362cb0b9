"""The compute stream: torch's current stream at each entry of the engine (forward, backward,
step) goes to the C++ Engine, whose kernels, copies and collectives then follow it and which it
waits for by stream events, never by the host (C++ Note [stream order], comm/stream_order.h). A
model run under ``with torch.cuda.stream(s):`` is thus ordered on s, with the default stream's
bits."""
import torch

from zerort import _C


def follow_current_stream(impl, device):
    """Tells the Engine (impl; None: the one about to be built) the stream the caller's work is
    on now: at forward, backward, step and the user's calls into its state (CUDA models only)."""
    if device.type != "cuda":
        return
    s = torch.cuda.current_stream(device)
    if impl is None:  # before the Engine exists: its constructor's kernels
        _C.set_compute_stream(s.device_index, s.cuda_stream)
    else:
        impl.set_compute_stream(s.stream_id, s.device_index, s.device_type, s.cuda_stream)

