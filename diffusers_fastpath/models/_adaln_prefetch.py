"""Every block's adaLN modulation launched when the first block asks, on a side stream beside the blocks' GEMMs.

Each FLUX.1 block begins with ``emb = self.linear(self.silu(temb))`` (diffusers' ``AdaLayerNormZero`` and
``AdaLayerNormZeroSingle``): the same ``temb`` in every block, one row per image against an [18432, 3072] weight
(9216 rows in the single blocks). Those GEMMs do almost no arithmetic and read their weights once: 6.4 GB, 76
memory-bound kernels, 2.2 ms of the 120 ms graph-replayed FLUX.1-dev step at 1024x1024 on an H200, while the
hidden-state GEMMs and attention around them are bound by the tensor cores and leave memory bandwidth unused. The
modulations depend on nothing but ``temb``, so when the first block asks for its own, `ModulationGroup` launches all
of them on a side stream (`side_stream`), where they run beside the first blocks' compute-bound kernels; each block
then waits only for its own output (one event each). It is the very same call, the module's own ``nn.Linear`` on the
same SiLU tensor (`_shared_silu`), made earlier and on another stream: the same kernel on the same values, so the
same bits (cuBLAS picks its algorithm from shapes, dtypes and alignment, never from the stream). Where there is no
second stream (CPU), the outputs are computed up front in order, which changes nothing but when.

A block computes its own modulation as written (counted nowhere: this is a schedule, not a fusion) when anything
could make the early call differ from the one eager makes in that block: the ``nn.Linear`` is not a plain one with
plain floating-point weights on the embedding's device (LoRA layers, quantized weights, offloaded weights), a hook
sits on the linear, its SiLU, the adaLN module or the block (offloading, layerwise casting, the first-block and
other caches that skip blocks), autograd records (grad enabled with an input or weight that requires grad), the
embedding is an inference tensor (no version counter: a write in place could not be seen) or ``torch.compile``
traces. The outputs are stored on the embedding tensor (`_rope_cache.derived`: a write in place to it launches
again); each output is handed out once, and a block asking twice computes its own.

Under CUDA-graph capture the side stream forks from the capturing stream and every output joins it again where its
block waits for it; a forward that never reaches some prefetching block cannot be captured (capture fails, the
graph runner runs that signature eager, said once).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from .._state import PatchState
from ..quality import hooked
from ._rope_cache import STATS_PREFIX, CacheStats, derived
from ._shared_silu import FastpathSharedSiLU

GROUP_ATTR = "_fastpath_adaln_prefetch"  # on each member: ``(group, index)``
STATS = STATS_PREFIX + "adaln_prefetch"  # on the model: tables launched (built), modulations served (reused)

_side_streams: dict[int, torch.cuda.Stream] = {}
_side_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The package's side stream on CUDA `device`, made on first use (default priority, like torch's own)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        with _side_lock:
            stream = _side_streams.get(index)
            if stream is None:
                stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


def _plain_weight(tensor: torch.Tensor | None, device: torch.device) -> bool:
    return tensor is None or (
        type(tensor) in (nn.Parameter, torch.Tensor)
        and tensor.is_floating_point()
        and tensor.device == device
        and not (tensor.requires_grad and torch.is_grad_enabled())
    )


LOOKAHEAD = 2  # members launched ahead of the one asking: one dual block's two, or two single blocks'


class _Table:
    """One forward's modulations: the members fit to prefetch, how far they are launched, the outputs (each handed
    out once) and, on CUDA, the event recorded after each."""

    __slots__ = ("x", "fit", "launched", "outputs", "events", "pending")

    def __init__(self, x: torch.Tensor | None, fit: list[int], size: int) -> None:
        self.x = x
        self.fit = fit
        self.launched = 0  # fit[:launched] are launched
        self.outputs: list[torch.Tensor | None] = [None] * size
        self.events: list[Any] = [None] * size
        self.pending = len(fit)


class ModulationGroup:
    """The adaLN modules of one model whose ``linear(silu(temb))`` share one ``temb`` (see module doc), in the order
    the forward calls them, each with the block it belongs to (whose hooks could skip or reorder it)."""

    def __init__(self, members: list[tuple[nn.Module, nn.Module]], stats: CacheStats) -> None:
        self.members = members
        self.stats = stats

    def _fit(self, index: int, emb: torch.Tensor) -> bool:
        module, block = self.members[index]
        linear, silu = getattr(module, "linear", None), getattr(module, "silu", None)
        return (
            type(linear) is nn.Linear
            and type(silu) is FastpathSharedSiLU
            and GROUP_ATTR in module.__dict__
            and _plain_weight(linear.weight, emb.device)
            and _plain_weight(linear.bias, emb.device)
            and not any(hooked(m) for m in (linear, silu, module, block))
        )

    def _table(self, emb: torch.Tensor) -> _Table:
        fit = [i for i in range(len(self.members)) if self._fit(i, emb)]
        x = self.members[fit[0]][0].silu(emb) if fit else None  # every member's shared SiLU gives this one tensor
        if fit:
            self.stats.built += 1
        return _Table(x, fit, len(self.members))

    def _launch_through(self, table: _Table, index: int, device: torch.device) -> None:
        """Launch the fit members after those launched, through `LOOKAHEAD` members past `index`."""
        stop = table.launched
        while stop < len(table.fit) and table.fit[stop] <= index + LOOKAHEAD:
            stop += 1
        if stop == table.launched:
            return
        chunk = table.fit[table.launched:stop]
        if device.type == "cuda":
            main = torch.cuda.current_stream(device)
            side = side_stream(device)
            side.wait_stream(main)  # beside the work enqueued from here on, not ahead of it
            with torch.cuda.stream(side):
                for i in chunk:
                    table.outputs[i] = self.members[i][0].linear(table.x)
                    table.events[i] = torch.cuda.Event()
                    table.events[i].record(side)
            if table.launched == 0:
                table.x.record_stream(side)  # read there: its memory is not reused before the side stream is done
        else:
            for i in chunk:
                table.outputs[i] = self.members[i][0].linear(table.x)
        table.launched = stop

    def modulation(self, module: nn.Module, index: int, emb: torch.Tensor) -> torch.Tensor:
        """``module.linear(module.silu(emb))``, from this forward's table where it can be (see module doc)."""
        if (
            torch.compiler.is_compiling()
            or not isinstance(emb, torch.Tensor)
            or emb.is_inference()
            or (emb.requires_grad and torch.is_grad_enabled())
            or not self._fit(index, emb)
        ):
            return module.linear(module.silu(emb))
        table = derived(emb, (GROUP_ATTR, id(self)), lambda: self._table(emb), valid=lambda t: t.pending > 0)
        self._launch_through(table, index, emb.device)
        out = table.outputs[index]
        if out is None:  # not prefetched (unfit when the table was made), or already handed out: as written
            return module.linear(module.silu(emb))
        table.outputs[index] = None
        table.pending -= 1
        self.stats.reused += 1
        event = table.events[index]
        if event is not None:
            main = torch.cuda.current_stream(emb.device)
            main.wait_event(event)
            out.record_stream(main)  # made on the side stream, read here
        return out


def modulation(module: nn.Module, emb: torch.Tensor) -> torch.Tensor:
    """The adaLN modulation ``module.linear(module.silu(emb))`` of a patched adaLN `module`: from its group's launch
    when it has one (`ModulationGroup`), else as written."""
    entry = module.__dict__.get(GROUP_ATTR)
    if entry is None:
        return module.linear(module.silu(emb))
    return entry[0].modulation(module, entry[1], emb)


def prefetch_modulations(state: PatchState, model: nn.Module, members: list[tuple[nn.Module, nn.Module]]) -> None:
    """Make the adaLN modules `members` (``(module, block)`` in call order, every one fed the same ``temb`` by
    `model`'s forward) one `ModulationGroup`; `report` counts its launches and the modulations it served."""
    if not members:
        return
    stats = CacheStats()
    group = ModulationGroup(members, stats)
    state.set_attr(model, STATS, stats)
    for index, (module, _) in enumerate(members):
        state.set_attr(module, GROUP_ATTR, (group, index))
