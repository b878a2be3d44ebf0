"""A CUDA graph capture imitated on the CPU, for the forwards whose capture depends on the host (issue 40): a stand-in
graph backend that records as `graphs.CudaGraphs` does (a warm-up, then a capture pass with everything a capture
switches on: `_host_ops` and `_host_reads` answering, `_host_constants`' fills), and a torch function mode that
logs, in the capture pass, every call that on a GPU would copy host data to the device or wait for the device.

On the CPU every tensor is on the host, so "on the device" is imitated: a tensor the capture pass did not make (an
input, a weight, a buffer) is on the device, and so is anything made from one or made with a ``device=`` argument;
a tensor made from no tensor without a device (``torch.tensor(list)``, ``torch.arange(n)``, a ``device="cpu"`` of
this package's own fills) is on the host, as is anything made from host tensors alone. Then `HostTransfers` logs,
with the caller's file:line (the first frame outside torch, this module, `_host_ops`, `_host_constants` and
`_host_reads`):

- host data copied to the device: ``torch.tensor`` / ``as_tensor`` / ``asarray`` of Python values with a device
  (torch builds them on the host and copies them over: the ones `_host_constants` fills and `_host_ops` answers never
  reach torch), ``.to(device)`` / ``.cuda()`` / ``copy_`` / ``as_tensor`` of a host tensor, a host tensor or a Python
  list as an index of a device tensor, a host tensor written into one by indexing, ``torch.where`` with a 0-dim host
  operand (``where`` moves it over), ``x[indices] = number`` on a device tensor with tensor indices that are not
  a single mask (torch makes the number a host tensor and ``index_put_`` copies it: Qwen-Image 2.1's capture failed
  on that), and any other call that mixes a host tensor of one or more dimensions with device tensors;
- device values read on the host (a wait a capture refuses): ``tolist`` / ``item`` / ``int()`` / ``float()`` /
  ``bool()``, ``nonzero`` / ``argwhere`` / one-argument ``torch.where(condition)``, ``masked_select``, ``unique`` /
  ``unique_consecutive`` and ``bincount`` (their output sizes), ``torch.equal`` / ``allclose`` (a Python bool), a
  tensor formatted or printed (``f"{x}"``, ``str(x)``: ``__format__`` / ``__repr__``), ``.cpu()`` / ``.numpy()`` /
  ``.to("cpu")``, ``repeat_interleave`` by a tensor without an ``output_size``, indexing by a boolean mask (but
  ``x[mask] = number``: torch's ``masked_fill_``).

What it cannot see is what torch's C++ makes on the host by itself inside one call (cuDNN's boolean-mask zero in
``scaled_dot_product_attention``: tests/test_attention_bool_mask.py covers that one), and the kernels the GPU picks
(a CUDA-only op path runs its CPU fallback here).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from .. import _host_constants, _host_ops, _host_reads, graphs
from .checks import traced_graph

_FROM_DATA = {"tensor", "as_tensor", "asarray"}
# calls whose result needs a device tensor's values on the host (a Python value, or an output size read from it):
# each waits for the device
_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero", "argwhere", "cpu", "numpy",
          "masked_select", "unique", "unique_consecutive", "bincount", "equal", "allclose", "__format__", "__repr__"}
_MOVES = {"to", "cuda", "as_tensor", "asarray"}
_SKIPPED = (os.sep + "torch" + os.sep, __file__, _host_ops.__file__, _host_constants.__file__, _host_reads.__file__)


def _tensor_twins() -> dict:
    """The capture twins bound on ``torch.Tensor`` (`graphs.CAPTURE_TWINS`), by the name of the method each stands
    for: torch hands such a method's own call to a function mode as the twin (``handle_torch_function`` looks the
    name up on the class), which the mode must still know as that method (`_host_reads.tolist_twin` reads the device
    by torch's ``tolist`` where no host key answers it)."""
    return {twin: name for twins in graphs.CAPTURE_TWINS.values() for module, name, _, twin in twins
            if module is torch.Tensor}


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None and (any(s in frame.f_code.co_filename for s in _SKIPPED[:1])
                                 or frame.f_code.co_filename in _SKIPPED[1:]):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.replace("\\", "/").rsplit("/", 2)
    return f"{'/'.join(path[-2:])}:{frame.f_lineno}"


def _host_device(device: Any) -> bool:
    """A ``device=`` the forward means as the host: the string "cpu" (the package's own fills pass that; a forward's
    ``device=x.device`` is a `torch.device`, the device however the CPU imitates it)."""
    return isinstance(device, str) and device.startswith("cpu")


def _target_device(args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(given, device)`` of a ``.to(...)`` / ``as_tensor(..., device=)`` call."""
    if "device" in kwargs:
        return kwargs["device"] is not None, kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return True, a
        if isinstance(a, torch.Tensor):
            return True, a.device
    return False, None


class HostTransfers(TorchFunctionMode):
    """The mode of the module doc: `events` lists ``(what, where)`` of every host copy and device read seen."""

    def __init__(self) -> None:
        super().__init__()
        self.host = WeakIdKeyDictionary()
        self.events: list[tuple[str, str]] = []
        self.twins = _tensor_twins()

    def _is_host(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.host

    def _is_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t not in self.host

    def _log(self, what: str) -> None:
        self.events.append((what, _where()))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = self.twins.get(func) or getattr(func, "__name__", "")
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host_result = self._check(name, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if host_result:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.host[t] = True
        return out

    def _check(self, name: str, args: tuple, kwargs: dict, tensors: list) -> bool:
        """Logs what the call would move or read on a GPU; whether its result lives on the host."""
        on_host, on_device = self._is_host, self._is_device
        device = kwargs.get("device")
        if name in _FROM_DATA and args and not isinstance(args[0], torch.Tensor):
            if device is not None and not _host_device(device):
                self._log(f"torch.{name} of host values to the device")
                return False
            return True
        if not tensors:  # a factory: on the host unless given a device
            return device is None or _host_device(device)
        source = tensors[0]
        if name in _MOVES or name == "copy_":
            if name == "copy_":
                dst, src = args[0], args[1]
                if on_device(dst) and on_host(src):
                    self._log("copy_ of a host tensor into a device tensor")
                elif on_host(dst) and on_device(src):
                    self._log("copy_ of a device tensor into a host tensor (a read)")
                return on_host(dst)
            given, target = (True, "cuda") if name == "cuda" else _target_device(args, kwargs)
            if given and _host_device(target) and on_device(source):
                self._log(f".{name}('cpu') of a device tensor (a read)")
                return True
            if given and not _host_device(target) and on_host(source):
                self._log(f".{name}(device) of a host tensor")
                return False
            return on_host(source) and not given
        if name in _READS and any(map(on_device, tensors)):
            self._log(f"{name} of a device tensor (a read)")
        if name == "where" and len(args) == 1 and not kwargs and on_device(source):
            self._log("torch.where(condition) of a device tensor (a nonzero: a read)")
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
            if on_device(repeats) or (repeats is None and on_device(source)):
                self._log("repeat_interleave by a device tensor without output_size (a read)")
        if name in ("__getitem__", "__setitem__") and on_device(args[0]):
            parts = list(args[1]) if isinstance(args[1], tuple) else [args[1]]
            if any(isinstance(p, list) for p in parts):
                self._log(f"{name} with a Python list index (a host index tensor copied over)")
            if any(on_host(p) for p in parts):
                self._log(f"{name} with a host index tensor")
            value = args[2] if name == "__setitem__" and len(args) > 2 else None
            tensor_parts = [p for p in parts if isinstance(p, (torch.Tensor, list))]
            single_mask = (len(tensor_parts) == 1 and isinstance(tensor_parts[0], torch.Tensor)
                           and tensor_parts[0].dtype in (torch.bool, torch.uint8))
            masked_fill = single_mask and (isinstance(value, (bool, int, float, complex))
                                           or (on_host(value) and value.dim() == 0))  # (no nonzero)
            if any(on_device(p) and p.dtype in (torch.bool, torch.uint8) for p in parts) and not masked_fill:
                self._log(f"{name} with a boolean device mask (a nonzero: a read)")
            if name == "__setitem__" and len(args) > 2:
                if isinstance(value, (bool, int, float, complex)) and tensor_parts and not single_mask:
                    self._log("x[indices] = number on a device tensor (a host scalar index_put_ copies over)")
                if on_host(value) and (value.dim() > 0 or tensor_parts):
                    self._log("__setitem__ of a host tensor into a device tensor")
            return False
        if name == "where" and any(on_host(t) and t.dim() == 0 for t in tensors) and any(map(on_device, tensors)):
            self._log("torch.where with a 0-dim host operand (moved to the device)")
            return False
        host = [t for t in tensors if on_host(t)]
        if host and len(host) < len(tensors) and any(t.dim() > 0 for t in host):
            self._log(f"{name} mixes host and device tensors")
        return len(host) == len(tensors) and (device is None or _host_device(device))


class CapturePassGraphs:
    """A CPU stand-in for `graphs.CudaGraphs` that records as it does: a warm-up pass, then a capture pass with what
    a capture switches on (`_host_ops` and `_host_reads` answer as inside a capture, `_host_constants` fills small
    ``torch.tensor(values, device=...)``) under `HostTransfers`, whose outputs are the static outputs. A replay runs
    the capture pass again (unwatched) and writes them. `transfers` holds every capture pass's events; a backend with
    ``strict=True`` fails the capture on the first pass that has any (the runner then runs that signature eager and
    counts the reason, as a GPU would).

    With ``traced=True`` the capture pass is traced into aten ops (``make_fx``, as `testing.TracedGraphs` traces a
    forward) and a replay runs those ops, no Python: every value the capture pass took on the host stays baked in (the
    warm-up's answers, the key's reads, the fills' values, each Python number), as in a CUDA graph, while the static
    inputs, weights and kept tensors are read again. So a graph replayed for inputs whose host values its key does not
    hold gives the recording's numbers, as on a GPU; the untraced replay runs the forward's Python again and would
    read the new values."""

    device_type = "cpu"

    def __init__(self, strict: bool = False, traced: bool = False) -> None:
        self.strict, self.traced = strict, traced
        self.transfers: list[tuple[str, str]] = []

    def new_pool(self, device):
        return ("pool",)

    def pool_bytes(self, pool):
        return 0

    def capture_pass(self, fn, watched: bool = True):
        """`fn` run as inside a capture; `watched`: under `HostTransfers` (a replay is not: a real one runs no
        Python, and the runner replays outside the recording's capture twins and host-key side)."""
        saved = _host_ops._capturing, _host_reads._capturing
        _host_ops._capturing, _host_reads._capturing = (lambda: True), (lambda tensor: True)
        mode = HostTransfers()
        try:
            watch = mode if watched else contextlib.nullcontext()
            with _host_constants.constants_as_fills("cpu", lambda: True), watch:
                out = fn()
        finally:
            _host_ops._capturing, _host_reads._capturing = saved
        self.transfers.extend(mode.events)
        if self.strict and mode.events:
            raise RuntimeError(f"Cannot copy between CPU and CUDA tensors during CUDA graph capture (imitated): "
                               f"{mode.events[0][0]} at {mode.events[0][1]}")
        return out

    def record(self, pool, fn):
        fn()  # the warm-up
        if self.traced:
            return traced_graph(lambda: self.capture_pass(fn))
        out = self.capture_pass(fn)
        backend = self

        class Replay:
            def replay(self):
                new_out = backend.capture_pass(fn, watched=False)
                for static, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(new_out)):
                    static.copy_(new)

        return Replay(), out
