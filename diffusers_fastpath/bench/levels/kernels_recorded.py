"""The kernels level of every model without hand-written cases (`kernels.KERNEL_CASES` cover six families): the fused
ops' calls of one lossless step, recorded at the shapes, strides and dtypes the model really gives them (read from
the model, not written per family), each then timed against its eager reference on copies of its recorded inputs.

A call is recorded where its kernel ran (the guard took it): the first call of each signature (the op, and the shape,
strides, dtype and 16-byte alignment of every tensor argument, the type of every module argument), with how many
calls of it one step makes. Its tensors are copied with their whole storage, so a chunk view keeps the strides and
offset it had (the kernels' row-stride and alignment paths are the model's). The recorded inputs are kept up to a
byte budget; calls past it are counted, not timed.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...ops._policy import FusedOp, capturing
from ..timing import progress
from .kernels import KernelCase, _input_sets, _kernel_row


@dataclass
class Recorded:
    """What one step gave the fused ops: a prototype call per signature (`calls`: signature -> [op, args, count]),
    and the calls not timed (`dropped`: op name -> count): past the byte budget, or, found by `recorded_cases`, of an
    op whose kernel writes into an argument instead of returning its result."""

    budget_bytes: int
    calls: dict[tuple, list] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    kept_bytes: int = 0


def _describe(value: Any) -> Any:
    """The part of an argument that decides which kernel runs and how fast: a tensor's layout, a module's type."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.data_ptr() % 16)
    if isinstance(value, nn.Module):
        return ("module", type(value).__qualname__, tuple((n, tuple(p.shape), p.dtype)
                                                          for n, p in value.named_parameters(recurse=False)))
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    if callable(value):  # a function the op calls (a model's row selection): by name, not by its address
        return ("callable", getattr(value, "__qualname__", type(value).__qualname__))
    slots = getattr(type(value), "__slots__", ())
    if slots:  # an argument object (`ops.selected_rows`' rows): its fields, so each call's new one is not a new case
        return ("object", type(value).__qualname__, tuple((s, _describe(getattr(value, s, None))) for s in slots))
    return ("value", repr(value)[:80])


def copy_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in a storage of its own with `t`'s offset, sizes and strides (a view keeps its layout: a
    broadcast or overlapping view too, which no elementwise copy could write)."""
    storage = t.untyped_storage()
    own = torch.empty(storage.nbytes(), dtype=torch.uint8, device=t.device)
    own.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(own.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


def _copy_args(args: tuple) -> tuple:
    return tuple(copy_like(a) if isinstance(a, torch.Tensor) else
                 (type(a)(_copy_args(tuple(a))) if isinstance(a, (tuple, list)) else a) for a in args)


def _tensor_bytes(value: Any, whole_storage: bool = False) -> int:
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes() if whole_storage else value.numel() * value.element_size()
    if isinstance(value, nn.Module):
        return sum(p.numel() * p.element_size() for p in value.parameters(recurse=False))
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v, whole_storage) for v in value)
    return 0


@contextlib.contextmanager
def recording(budget_bytes: int = 8 * 2**30) -> Iterator[Recorded]:
    """Within the block, every fused call whose kernel runs is recorded (`Recorded`); `FusedOp.try_fast`, the one
    path of every eager fused call, is wrapped for the block only (the package's own code is not changed)."""
    rec = Recorded(budget_bytes)
    original = FusedOp.try_fast

    def try_fast(op: FusedOp, site, *args):
        out = original(op, site, *args)
        if out is not None and not capturing():
            key = (op.name, _describe(args))
            entry = rec.calls.get(key)
            if entry is not None:
                entry[2] += 1
            elif rec.kept_bytes + (size := _tensor_bytes(args, whole_storage=True)) <= rec.budget_bytes:
                rec.calls[key] = [op, _copy_args(args), 1]
                rec.kept_bytes += size
            else:
                rec.dropped[op.name] = rec.dropped.get(op.name, 0) + 1
        return out

    FusedOp.try_fast = try_fast
    try:
        yield rec
    finally:
        FusedOp.try_fast = original


def _poisoned(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, called where the memory its outputs will get was filled with NaN just before: its outputs' sizes are
    learnt from one call, blocks of those sizes are filled and freed, and the caching allocator hands them to the
    next call's outputs (best effort: the check `equal` makes of the kernel's every element being written)."""
    def call(*args):
        outs = fn(*args)
        flat = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if isinstance(o, torch.Tensor)]
        sizes = [(o.untyped_storage().nbytes(), o.device) for o in flat]
        del outs, flat
        poison = [torch.full((n // 4,), float("nan"), device=d) for n, d in sizes]
        del poison
        return fn(*args)
    return call


def recorded_cases(rec: Recorded) -> Iterator[tuple[KernelCase, int]]:
    """One `KernelCase` per recorded signature, with how many calls of it one step makes (made one at a time: each
    holds its input sets): the kernel (``op.kernel``, no guard or verification in between) against the eager
    reference (``op.ref``), on fresh copies of the recorded inputs rotated past the L2 cache; bytes: every tensor
    argument read once (modules: their parameters) and every output written once."""
    for (name, _), (op, args, count) in rec.calls.items():
        result = op.kernel(*args)
        outs = result if isinstance(result, (tuple, list)) else [result]
        if not outs or not all(isinstance(o, torch.Tensor) for o in outs):  # an op that writes into an argument
            rec.dropped[name] = rec.dropped.get(name, 0) + count  # (its result is not what the row compares)
            continue
        nbytes = _tensor_bytes(args) + _tensor_bytes(outs)
        del result, outs
        sets = _input_sets(lambda args=args: _copy_args(args))
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        shape = tuple(first.shape) if first is not None else ()
        yield KernelCase(name, shape, sets, op.ref, op.kernel, nbytes, checked=_poisoned(op.kernel)), count


def record_step(subject, show: bool = False) -> Recorded:
    """One lossless step of `subject` with every fused call recorded (patched for the step, unpatched after; the
    model-level verification off: this step's numbers are not compared, each case is, by `kernels._kernel_row`)."""
    import diffusers_fastpath as fp

    fp.patch(subject.transformer, verify=False)
    try:
        subject.step()  # the first calls: kernels loaded, each signature self-verified (not recorded)
        with recording() as rec:
            subject.step()
    finally:
        fp.unpatch(subject.transformer)
    return rec


def run_recorded(subject, args: argparse.Namespace, device: torch.device, show: bool) -> dict[str, Any]:
    """The kernels level from the fused calls one lossless step of `subject` makes: a row per signature
    (`kernels._kernel_row`), with its calls per step (``calls``) and ``source: "recorded"``."""
    if device.type != "cuda":
        return dict(ran=False, reason="needs CUDA (the fused kernels are CUDA kernels)", rows=[], host_us_per_call={})
    from ...ops._build import load_extension

    load_extension()
    rec = record_step(subject)
    rows = []
    with progress(len(rec.calls), "kernels", show) as bar:
        for case, count in recorded_cases(rec):
            rows.append(dict(_kernel_row(case), calls=count, source="recorded"))
            del case
            bar.update()
    dropped = (f"; calls not timed (past the recording budget, or of an op that writes into an argument): "
               f"{rec.dropped}" if rec.dropped else "")
    reason = None if rows else f"no fused call ran in a lossless step of {subject.name}" + dropped
    return dict(ran=bool(rows), reason=reason, rows=rows, host_us_per_call={}, dropped=rec.dropped,
                note="recorded from one lossless step" + dropped)
