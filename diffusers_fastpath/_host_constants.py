"""Small tensors a forward builds from Python values on the GPU, made capturable: ``torch.tensor(values,
device=cuda)`` inside a CUDA graph capture.

``torch.tensor([8, 32, 32], device="cuda")`` builds the tensor on the host and copies it to the GPU from pageable
memory, which a capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU
tensor is pinned"): LTX-2's rotary coordinates (``LTX2AudioVideoRotaryPosEmbed.prepare_video_coords``:
``torch.tensor(patch_size, ...)``, ``torch.tensor(self.scale_factors, ...)``) do this in every forward, so no graph of
LTX-2 could be captured. Inside `constants_as_fills`, such a call on a capturing stream makes the same tensor on the
device instead, one ``fill_`` per element with the value the host tensor holds: a kernel whose argument is that value,
captured like any other, so each replay writes the same values again. Nothing is read from the host at replay.

That is what a capture already does with every Python number a forward passes to a kernel (an ``eps``, a ``theta``, a
scale): the values are baked in, which is why the graph runner keys each graph on the call's plain arguments and
re-checks every module's plain attributes before a replay (`graphs.ModelFingerprint`: ``scale_factors`` is one).
The tensor is the one eager builds (its values, dtype, shape; contiguous), and only small ones are made this way (at
most `MAX_ELEMENTS`): a larger one still fails the capture, which then leaves that signature eager, as before.
Anything else (no device given, a CPU device, data that is not Python numbers (a tensor, an array), ``requires_grad``,
``pin_memory``, a stream that is not capturing, another thread's call) runs torch's own ``torch.tensor``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

MAX_ELEMENTS = 64  # one fill kernel each: coordinates' scale factors and patch sizes have 3

_TOLIST = torch._C.TensorBase.tolist  # torch's own (see `_host_values`)

_lock = threading.Lock()
_depth = 0
_saved: Callable | None = None  # the ``torch.tensor`` found when the replacement went in, put back when it goes
_installed: Callable | None = None  # the replacement, while it is in


def _python_values(data, budget: list[int]) -> bool:
    """Whether `data` is Python numbers (or nested lists / tuples of them), at most ``budget[0]`` of them."""
    if isinstance(data, (bool, int, float, complex)):
        budget[0] -= 1
        return budget[0] >= 0
    return isinstance(data, (list, tuple)) and all(_python_values(x, budget) for x in data)


def _host_values(host: torch.Tensor) -> list:
    """The values of this filler's own host tensor, read by torch's C ``tolist`` with torch functions off: not by
    ``torch.Tensor.tolist`` as bound now, nor through a torch function mode (which hands it the bound one). While a
    model with host reads records, that is `_host_reads.tolist_twin`, which counts each read as one of the forward's:
    Bria FIBO 2's ``torch.tensor(gist_counts, device=...)`` made its capture read once more than its key held (and
    its warm-up, which makes no fills, did not), so that signature ran eager. Nor is it a data-dependent call of the
    model's module for `_host_ops` to answer: it reads a host tensor built here from the module's Python values."""
    with torch._C.DisableTorchFunction():
        return _TOLIST(host.reshape(-1))


def _tensor_factory(real: Callable, device_type: str, capturing: Callable[[], bool]) -> Callable:
    def tensor(data, *args, **kwargs):
        device = kwargs.get("device")
        if (_depth == 0 or args or device is None or kwargs.get("requires_grad") or kwargs.get("pin_memory")
                or not _python_values(data, [MAX_ELEMENTS])):
            return real(data, *args, **kwargs)
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError):
            return real(data, *args, **kwargs)
        if device.type != device_type or not capturing():
            return real(data, *args, **kwargs)
        host = real(data, **{**kwargs, "device": "cpu"})
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        flat = out.view(-1)
        for i, value in enumerate(_host_values(host)):
            flat[i].fill_(value)
        return out

    tensor.__doc__ = real.__doc__
    tensor.__wrapped__ = real
    tensor._fastpath_host_constants = True
    return tensor


@contextlib.contextmanager
def constants_as_fills(device_type: str = "cuda",
                       capturing: Callable[[], bool] = torch.cuda.is_current_stream_capturing) -> Iterator[None]:
    """Within this block, ``torch.tensor(python values, device=<device_type>)`` called while `capturing()` builds its
    tensor with fill kernels (module doc). Process-wide, so it is installed once however many threads capture at a
    time (the first to enter installs it, the last to leave puts torch's back); on any other call the replacement is
    torch's own ``torch.tensor``. Leaving puts back what was there only where the replacement is still in (another
library's replacement installed meanwhile stays), and a replacement kept by someone after the last block left
calls straight through. `device_type` and `capturing` are parameters for the tests (a CPU has no capture)."""
    global _depth, _saved, _installed
    with _lock:
        if _depth == 0:
            _saved = torch.tensor
            while getattr(_saved, "_fastpath_host_constants", False):  # one of ours someone kept and put back
                _saved = _saved.__wrapped__
            _installed = torch.tensor = _tensor_factory(_saved, device_type, capturing)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if torch.tensor is _installed:  # (one installed by someone else meanwhile stays theirs)
                    torch.tensor = _saved
                _saved = _installed = None
