"""A forward's data-dependent ops, recorded in its warm-up and answered in its capture: what lets a forward whose
layout follows from its inputs' values (Qwen-Image 2.1's image-slot mask) be captured.

Some forwards turn an input's values into shapes, positions and Python numbers with ops that must wait for the GPU:
Qwen-Image 2.1 expands its image slots with ``repeat_interleave(mask, repeats)`` (its output size is a sum of
``repeats``), scatters tokens by boolean masks (``x[:, mask] = y``: a ``nonzero``), reads ``mask.tolist()`` and
``int(mask.sum())``, finds positions with ``nonzero`` and builds index tables from Python lists with
``torch.tensor(list, device=...)`` (a pageable host-to-device copy): none of this may run inside a CUDA graph capture.
Its graphs are keyed on those input values (`graphs.register_host_key`: a graph recorded for some values is never
replayed for others), and every one of these ops gives the same answer for the same key. So while a signature of such
a model records, `replayed` (a torch function mode, on the recording thread only) stands between the forward and:

- ``tolist``, ``item``, ``int()``, ``float()``, ``bool()`` of a device tensor: the warm-up (outside the capture)
  reads the value as eager does; the capture returns that value;
- ``nonzero`` of a device tensor: the warm-up's result is kept; the capture returns a copy of it (a device copy);
- ``repeat_interleave`` with a tensor of repeats and no ``output_size``: the capture passes the output size the
  warm-up's result had (torch's own argument for this, which skips the wait and changes no value);
- indexing (``x[...]``, ``x[...] = y``) with a boolean device mask: in both passes the mask is replaced by its
  ``nonzero`` indices, computed in the warm-up and kept (what torch's indexing does with a boolean mask itself);
- ``x[indices] = number`` on a device tensor, with tensor indices or a mask (Qwen-Image 2.1's
  ``target_token_mask[image_positions[-n:]] = True``): torch makes the number a host tensor of ``x``'s dtype
  (``THPVariable_setitem`` on a CUDA tensor) and ``index_put_`` copies it to the device (``value.to(self.device())``:
  a pageable copy, refused in a capture; a single mask would go to ``masked_fill_`` instead, but the mask is now
  indices). In both passes the number is handed over as that 0-dim tensor filled on the device: the same value
  (the same conversion of the number to ``x``'s dtype) written by the same ``index_put_`` kernel;
- ``torch.tensor(python values, device=<the GPU>)`` of more than `_host_constants.MAX_ELEMENTS` values (smaller ones
  are filled in by `_host_constants`): the warm-up's tensor is kept; the capture returns a copy of it.

The capture's calls must come in the warm-up's order, of the same kinds on tensors of the same shapes; anything else
raises, so the capture fails and that signature runs eager, with the reason in `report`. What was kept lives as long
as the graph (`graphs._Graph.keep`). Nothing else is touched: every other call goes to torch as the forward made it.
The recorded kernels are those eager launches for those values (the same gathers, scatters and copies), and the
first replay is compared with the eager forward as always.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from . import _host_constants
from ._host_constants import MAX_ELEMENTS, _python_values

_T = torch.Tensor
_VALUES = {_T.tolist, _T.item, _T.__int__, _T.__float__, _T.__bool__, _T.__index__}
_NONZERO = {_T.nonzero, torch.nonzero}
_REPEAT = {_T.repeat_interleave, torch.repeat_interleave}
_INDEX = {_T.__getitem__, _T.__setitem__}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_TENSOR = torch.tensor  # torch's own (`_host_constants` puts its filler there inside a capture)
_HANDLED = frozenset({*_VALUES, *_NONZERO, *_REPEAT, *_INDEX, _TENSOR})
_PASS_THROUGH = frozenset({__file__, _host_constants.__file__})


class HostOps:
    """One recording's answers, in the order the forward asked: ``(kind, what, answer)`` entries (`what` names the
    call and its tensors' shapes, checked again in the capture)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, tuple, Any]] = []
        self.next = 0

    def add(self, kind: str, what: tuple, answer: Any) -> Any:
        self.entries.append((kind, what, answer))
        return answer

    def take(self, kind: str, what: tuple) -> Any:
        if self.next >= len(self.entries):
            raise RuntimeError(f"the capture made a data-dependent call its warm-up did not ({kind} {what})")
        got_kind, got_what, answer = self.entries[self.next]
        if (got_kind, got_what) != (kind, what):
            raise RuntimeError(f"the capture's data-dependent call {self.next + 1} ({kind} {what}) is not its "
                               f"warm-up's ({got_kind} {got_what})")
        self.next += 1
        return answer


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _index_parts(index) -> tuple[list, bool]:
    parts = list(index) if isinstance(index, tuple) else [index]
    return parts, isinstance(index, tuple)


def _scatters(parts: list) -> bool:
    """Whether an index with these parts writes by tensor indices (``index_put_``): a tensor of indices or a mask."""
    return any(isinstance(p, torch.Tensor) and (p.dim() >= 1 or p.dtype is torch.bool) or isinstance(p, list)
               for p in parts)


def _number(value: Any) -> bool:
    return isinstance(value, (bool, int, float, complex))


def _caller_file() -> str:
    """The file of the Python code that made the torch call being handled (past this module and `_host_constants`'s
    ``torch.tensor`` filler). Not past torch's own Python: a call torch makes inside a function the model's module
    called (flex attention's block mask, say) is torch's, not the module's, and goes to torch as made. (Every call
    handled here is a C method or function of torch's: nothing of torch's stands between it and its caller.)"""
    frame = sys._getframe(2)  # (0: this function, 1: the mode's handler)
    while frame is not None and frame.f_code.co_filename in _PASS_THROUGH:
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_filename


class _Replayed(TorchFunctionMode):
    def __init__(self, ops: HostOps, device_type: str, capturing: Callable[[], bool], files: tuple[str, ...]) -> None:
        super().__init__()
        self.ops, self.device_type, self.capturing, self.files = ops, device_type, capturing, files

    def _on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device_type

    def _bool_mask(self, t: Any) -> bool:
        return self._on_device(t) and t.dtype in (torch.bool, torch.uint8) and t.dim() >= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (func in _HANDLED and any(name in _caller_file() for name in self.files)):
            return func(*args, **kwargs)
        _on_device, _bool_mask = self._on_device, self._bool_mask
        if func in _VALUES and args and _on_device(args[0]):
            what = (_name(func), tuple(args[0].shape))
            if self.capturing():
                return copy.deepcopy(self.ops.take("value", what))
            return copy.deepcopy(self.ops.add("value", what, func(*args, **kwargs)))
        if func in _NONZERO and args and _on_device(args[0]):
            what = (tuple(args[0].shape), bool(kwargs.get("as_tuple", False)))
            if self.capturing():
                kept = self.ops.take("nonzero", what)
                return tuple(t.clone() for t in kept) if isinstance(kept, tuple) else kept.clone()
            out = func(*args, **kwargs)
            self.ops.add("nonzero", what, out)
            return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        if func in _REPEAT and kwargs.get("output_size") is None:
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
            if _on_device(repeats) or (repeats is None and args and _on_device(args[0])):
                dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
                what = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)) + (dim,)
                if self.capturing():
                    return func(*args, **kwargs, output_size=self.ops.take("repeat", what))
                out = func(*args, **kwargs)
                self.ops.add("repeat", what, out.numel() if dim is None else out.shape[dim])
                return out
        if func in _INDEX and len(args) >= 2:
            parts, _ = _index_parts(args[1])
            index, rest = args[1], args[2:]
            if any(_bool_mask(p) for p in parts):
                what = (_name(func), tuple(args[0].shape),
                        tuple(tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for p in parts))
                if self.capturing():
                    indices = self.ops.take("index", what)
                else:
                    indices = self.ops.add("index", what, [p.nonzero(as_tuple=True) if _bool_mask(p) else None
                                                           for p in parts])
                new = []
                for p, idx in zip(parts, indices):
                    new.extend(idx if idx is not None else (p,))
                index, parts = tuple(new), new
            if (func is _T.__setitem__ and _on_device(args[0]) and _scatters(parts)
                    and _number(rest[0] if rest else None)):
                # ``x[indices] = number``: torch makes the number a host tensor and copies it over (module doc)
                rest = (torch.full((), rest[0], dtype=args[0].dtype, device=args[0].device),) + tuple(rest[1:])
            if index is not args[1] or rest is not args[2:]:
                return func(args[0], index, *rest, **kwargs)
        if func is _TENSOR and args and kwargs.get("device") is not None and not args[1:]:
            device = torch.device(kwargs["device"])
            data = args[0]
            if (device.type == self.device_type and isinstance(data, (list, tuple))
                    and _python_values(data, [1 << 62]) and not _python_values(data, [MAX_ELEMENTS])):
                what = (len(data), str(kwargs.get("dtype")))
                if self.capturing():
                    return self.ops.take("tensor", what).clone()
                out = func(*args, **kwargs)
                self.ops.add("tensor", what, out)
                return out.clone()
        return func(*args, **kwargs)


def replayed(ops: HostOps, files: tuple[str, ...], device_type: str = "cuda",
             capturing: Callable[[], bool] | None = None) -> TorchFunctionMode:
    """The mode that records the data-dependent calls on `device_type` tensors that code of `files` makes (a call
    counts where the name of the file it is made from contains one of them: diffusers' module, and this package's
    rewritten copies of its functions, whose file names hold the original's) in `ops` outside a capture, and answers
    them from `ops` inside one (`capturing()`, by default whether the current CUDA stream captures: the tests give
    their own, a CPU has no capture). Calls made from anywhere else go to torch as made. See the module doc."""
    ops.next = 0  # (each pass answers from the first call on)
    return _Replayed(ops, device_type, capturing or (lambda: _capturing()), tuple(files))
