"""Host reads of a forward answered from its graph key while a CUDA graph records: ``tensor.tolist()`` inside a
capture.

A forward that reads values of its inputs on the host (Bria FIBO 2's ``encoder_attention_mask.sum(dim=1).tolist()``,
the text lengths that set its gist count, hence its shapes and loops) cannot be captured as written: ``.tolist()`` of
a device tensor waits for the GPU, which a capturing stream refuses ("operation not permitted when stream is
capturing"). The graph runner already keys such a forward's graphs on those values (`graphs.register_host_key`: read
from a host copy of the inputs before every call, part of the signature, so a graph recorded for some values is
never replayed for others). Here the same values answer the forward's reads while it records:

- the model's host key gives, as its side (`graphs.capture_side`), a `HostReads`: the values the forward's
  ``.tolist()`` calls will read, in the order it makes them;
- `tolist_twin` is what ``torch.Tensor.tolist`` is bound to while such a model records
  (`graphs.register_capture_twin`); on the recording thread, with a `HostReads` side, each call takes the next value:
  outside the capture (the warm-up, on any device) it reads the tensor as eager does and checks that it is that value;
  inside the capture it returns the value without touching the device. A read the side does not hold, or one that
  differs from it, raises: the capture fails and that signature runs eager, with the reason in `report` (so no read
  of the forward goes unkeyed). Any other call (another thread, no such side) is torch's own ``tolist``.

Nothing of the recorded kernels changes: they are the ones eager launches for those values, and the first replay is
compared with the eager forward as always.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from . import graphs

_TOLIST = torch.Tensor.tolist


class HostReads:
    """The values (in order) that a forward's ``.tolist()`` calls read, for one recording; `answered` counts the
    calls per pass (the warm-up outside the capture, the capture)."""

    __slots__ = ("values", "answered")

    def __init__(self, values: list[Any]) -> None:
        self.values = list(values)
        self.answered = {False: 0, True: 0}

    def answer(self, tensor: torch.Tensor, capturing: bool) -> Any:
        index = self.answered[capturing]
        self.answered[capturing] += 1
        if index >= len(self.values):
            raise RuntimeError(f"a host read the graph key does not hold: .tolist() of a {tuple(tensor.shape)} "
                               f"{tensor.dtype} tensor (read {index + 1} of {len(self.values)} keyed)")
        want = self.values[index]
        if not capturing:
            got = _TOLIST(tensor)
            if got != want:
                raise RuntimeError(f"host read {index + 1} of the forward ({got!r:.80}) is not the graph key's "
                                   f"({want!r:.80})")
        return copy.deepcopy(want)  # (a list the forward may change in place)


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def tolist_twin(tensor: torch.Tensor) -> Any:
    """``torch.Tensor.tolist`` while a model with host reads records (module doc)."""
    side = graphs.capture_side()
    if not isinstance(side, HostReads):
        return _TOLIST(tensor)
    return side.answer(tensor, _capturing(tensor))


def register_tolist_reads(model_cls: type, key) -> None:
    """`key` (``fn(model, call) -> (key, side)``, its side giving a `HostReads`) as the host key of `model_cls`
    forwards, and ``.tolist()`` answered from it while one records."""
    graphs.register_host_key(model_cls, key)
    graphs.register_capture_twin(model_cls, torch.Tensor, "tolist", tolist_twin)
