"""The parts level: what each kind of work costs a step where it runs, at the clock the power limit leaves it.

A profile sums kernel times, and under a power limit that sum is not the step's floor: a step with less light work
between its GEMMs spends more of its time at the limit, where the SM clock drops and every GEMM slows. So this level
measures instead of summing. It records every dispatcher op of one step of a mode (a ``TorchDispatchMode``: the same
calls on the same tensors, this package's kernels included, since they are registered ops), sorts them into
`PART_CATEGORIES`, and replays, round-robin and each as one CUDA graph:

- **whole**: every recorded op; it should take what the mode's step replayed as a CUDA graph takes;
- **floor**: only the GEMMs, the one-row projections (GEMVs) and attention: the step's floor, at the clock the card
  gives those kernels when nothing else runs;
- **without X**, for each category X the step has: whole minus that category's ops. Its cost in the step is whole
  minus without-X, which a sum of kernel times does not give at a power limit.

Ops that change their inputs in place (a residual stream updated where it lies) change the recorded tensors on each
replay: the values drift, the work does not. Host-side ops (a tensor on the CPU, a read of a GPU value) are left out
and counted. The level runs the non-compiled modes without CUDA graphs (eager, lossless, high): a graphs mode
replays what its base mode records, and a compiled mode's kernels are not dispatcher calls. On a CPU the parts are
replayed as plain calls, timed on the wall clock. Memory: the recording keeps one step's intermediate tensors alive.
"""

from __future__ import annotations

import re
import statistics
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..._logging import logger
from ...graphs import CudaGraphs
from ..modes import Mode, applied
from ..sensors import Readings
from ..subject import Subject
from ..timing import Clock

PART_CATEGORIES = ("gemm", "gemv", "attention", "fused", "elementwise")
FLOOR = ("gemm", "gemv", "attention")
GEMV_ROWS = 16  # a projection of at most this many rows reads its weight once: memory-bound (adaLN, embedders)
_GEMM = re.compile(r"^aten\.(addmm|_addmm_activation|mm|bmm|baddbmm|addbmm)\.")
_ATTENTION = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention")
_ALLOC = re.compile(r"^aten\.(empty|empty_like|empty_strided|new_empty|new_empty_strided)\.")
_HOST = re.compile(r"^aten\.(_local_scalar_dense|item|equal|is_nonzero)\.")


def op_category(name: str, func: Any, args: tuple) -> str | None:
    """The category (`PART_CATEGORIES`) of a recorded op, or None for one that launches no kernel (a view, an
    allocation): those stay in every part."""
    if getattr(func, "is_view", False) or _ALLOC.match(name):
        return None
    if _GEMM.match(name):
        mat = args[0] if name.startswith(("aten.mm", "aten.bmm")) else args[1]  # after the bias where there is one
        return "gemv" if isinstance(mat, torch.Tensor) and mat.dim() >= 2 and mat.shape[-2] <= GEMV_ROWS else "gemm"
    if _ATTENTION.search(name):
        return "attention"
    if name.startswith("diffusers_fastpath."):
        return "fused"
    return "elementwise"


class Recorder(TorchDispatchMode):
    """Every dispatcher op of the calls made inside it, with its arguments: ``ops`` is a list of
    ``(name, func, args, kwargs, category)``; ops that touch the host on a CUDA device are counted in ``host_ops``
    and left out."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ops: list[tuple[str, Any, tuple, dict, str | None]] = []
        self.host_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if self.device.type == "cuda" and (_HOST.match(name) or any(
                isinstance(t, torch.Tensor) and t.device.type != "cuda" for t in pytree.tree_leaves((args, kwargs)))):
            self.host_ops += 1
        else:
            self.ops.append((name, func, args, kwargs, op_category(name, func, args)))
        return func(*args, **kwargs)


def parts_of(ops: list) -> dict[str, list]:
    """The replayed parts: whole, floor, and without each category the step has (views and allocations in all)."""
    present = [c for c in PART_CATEGORIES if any(op[4] == c for op in ops)]
    parts = {"whole": ops, "floor": [op for op in ops if op[4] is None or op[4] in FLOOR]}
    for c in present:
        parts[f"without {c}"] = [op for op in ops if op[4] != c]
    return parts


def _replayer(ops: list) -> Callable[[], None]:
    def replay() -> None:
        for _, func, args, kwargs, _ in ops:
            func(*args, **kwargs)
    return replay


def _graphed(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """`fn` captured as one CUDA graph in a pool of its own, by the capture `cuda_graphs=True` uses (warm-up on the
    capture stream; a failed capture leaves the device's generator usable)."""
    cuda = CudaGraphs()
    graph, _ = cuda.record(cuda.new_pool(device), fn)
    return graph.replay


def parts_modes(modes: list[Mode]) -> tuple[list[Mode], dict[str, str]]:
    """The modes the level can record, and why each other one cannot."""
    ok, skipped = [], {}
    for mode in modes:
        if mode.compiled:
            skipped[mode.name] = "compiled: its kernels are not dispatcher calls"
        elif mode.graphs:
            skipped[mode.name] = "replays CUDA graphs: its base mode's recording is what it replays"
        else:
            ok.append(mode)
    return ok, skipped


def _counts(ops: list) -> dict[str, int]:
    return {c: sum(op[4] == c for op in ops) for c in PART_CATEGORIES}


def parts_of_mode(mode: Mode, subject: Subject, clock: Clock, ctx: Any, repeats: int,
                  eager_ms: float | None) -> list[dict[str, Any]]:
    """One mode's rows: record a step, replay its parts round-robin ``repeats`` times."""
    device = clock.device
    with applied(mode, subject.transformer, ctx):
        clock.time(subject.step)  # warm-up: caches, self-verification
        rec = Recorder(device)
        with rec:
            subject.step()
        clock.sync()
    parts = parts_of(rec.ops)
    rows, timed = [], {}
    for name, ops in parts.items():
        row = dict(mode=mode.name, part=name, ops=_counts(ops), host_ops_left_out=rec.host_ops, available=True,
                   reason=None, graphed=clock.cuda, ms_all=[], readings=Readings() if clock.sensors else None)
        try:
            timed[name] = _graphed(_replayer(ops), device) if clock.cuda else _replayer(ops)
        except Exception as exc:  # noqa: BLE001 - one part that cannot be captured must not cost the others
            row.update(available=False, reason=f"{type(exc).__name__}: {exc}"[:300])
        rows.append(row)
    by_part = {r["part"]: r for r in rows}
    for _ in range(repeats):
        for name, fn in timed.items():
            fn()  # one untimed replay per round, as the step level warms each mode
            row = by_part[name]
            _, ms, _ = clock.time(fn, row["readings"])
            row["ms_all"].append(ms)
    del timed, parts, rec
    if clock.cuda:
        torch.cuda.empty_cache()
    whole = statistics.median(by_part["whole"]["ms_all"]) if by_part["whole"]["ms_all"] else None
    for row in rows:
        readings = row.pop("readings")
        row["sensors"] = readings.summary() if readings is not None else None
        row["ms"] = statistics.median(row["ms_all"]) if row["ms_all"] else None
        row["vs_eager_step"] = row["ms"] / eager_ms if row["ms"] is not None and eager_ms else None
        row["cost_ms"] = (whole - row["ms"]) if row["part"].startswith("without ") and row["ms"] is not None \
            and whole is not None else None
    return rows


def run_parts(modes: list[Mode], subject: Subject, clock: Clock, ctx: Any, repeats: int,
              eager_ms: float | None) -> dict[str, Any]:
    """The level's result: a row per (mode, part), and the modes it could not record with why."""
    ok, skipped = parts_modes(modes)
    rows = []
    for mode in ok:
        try:
            rows += parts_of_mode(mode, subject, clock, ctx, repeats, eager_ms)
        except torch.OutOfMemoryError as exc:
            skipped[mode.name] = f"out of memory keeping one step's tensors for the replay: {exc}"[:300]
        except Exception as exc:  # noqa: BLE001 - a mode this level cannot record must not cost the others
            skipped[mode.name] = f"failed: {type(exc).__name__}: {exc}"[:300]
        else:
            continue
        logger.warning(f"diffusers_fastpath.bench: parts of {mode.name}: {skipped[mode.name]}")
        if clock.cuda:
            torch.cuda.empty_cache()
    return dict(ran=True, reason=None, repeats=repeats, graphed=clock.cuda, eager_step_ms=eager_ms,
                rows=rows, skipped=skipped)
