"""Values derived once per forward and shared by every layer, owned by the tensor they derive from.

Diffusers builds a transformer's rotary table once per forward (``FluxTransformer2DModel.forward`` calls
``pos_embed(ids)`` once and hands the result to every block), which is exact by construction: this package keeps
that and adds no cache across forwards. What the layers still recompute each from that one table and the forward's
other shared inputs (ERNIE-Image's ``torch.cos``/``torch.sin`` of the angles, for q and for k; Chroma's and
HunyuanVideo-1.5's attention-mask products) is derived here once per table tensor and stored *on that tensor*
(`derived`): the value lives at most as long as the table, belongs to the forward that built it (two threads, two
forwards, two tables).

A later layer reuses it only if nothing could have changed the tensors it came from since, and version counters do
not see every write (``.data``, a tensor sharing the storage, in place on an inference tensor: `_driver`). So a table
is *sealed* for the forward that first derives from it, or never: where its layers are called straight from the
patched model's own diffusers forward (`_driver.enclosing_model_forward`), no module of the model has hooks
(`_policy.hooks_on`, which also sees global hooks and a ``forward`` replaced on an instance; the model's own run
before the table exists or after the layers), every attention processor is diffusers' or this package's (the
processor is handed the table, the mask and the shared product), and every module of the model's block lists is
diffusers' or this package's. Then nothing but diffusers' and this package's code holds those tensors until the
forward ends, and each later use, in the same forward, is checked to come from it. Elsewhere (hooks anywhere,
offloading, a cache library's loop, a foreign processor) every layer computes its own, as written. The version counters
of the table and of the stored value stay a second line.

The seal names one call of the forward, not its frame (`_driver.frame_key`: the frame's id and code and a token
planted in that call's locals; `_driver.inside` finds the frame by id and code and asks for that token). CPython reuses
a freed frame's id, for the next call of the model from the same line of a pipeline's loop too, so a frame's id alone
would let a tensor handed to more than one forward (a mask the pipeline passes unchanged to every step, a rotary table
that a user's ``pos_embed`` keeps across steps, a CUDA graph's static input buffers) hand the next forward the value
the last one derived, stale after a write between the two that no version counter sees (``.data``, a tensor sharing
the storage). Such a tensor is sealed for the first call that derives from it; in every later call each layer
computes its own, as written. A CUDA graph's static inputs are wiped before each run on them (`forget`:
`graphs.GraphRunner` runs the forward on them for the warm-up, then for the capture), so that the capture seals them
for itself and its layers share again, with no value of the warm-up's (a tensor computed outside the graph) to find.

Why not a cache across denoising steps keyed on the position ids: a key made of tensor identity, ``data_ptr`` and
``_version`` misses writes through ``.data`` or ``.numpy()`` and fails on inference tensors (they have no version
counter), a key taken from the model's arguments misses ids that a hook or a subclass changes before ``pos_embed``
sees them, and a key parked on a module is shared by two threads; a key by value needs a host sync per step. What
such a cache saved is a handful of small kernels per step (`FluxPosEmbed` on FLUX.1-dev's 4608 ids: 6 since
`_pos_embed` builds all axes at once), which CUDA graphs replay at no host cost anyway.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Hashable

import torch
from torch import nn

from ..ops._policy import global_module_hooks, own_hooks
from ._driver import enclosing_model_forward, frame_key, inside

STATS_PREFIX = "_fastpath_stats_"  # `report` lists every such attribute of a patched model's modules
_DERIVED_ATTR = "_fastpath_derived"
_SEAL_ATTR = "_fastpath_sealed"  # on a table: `frame_key` of the call that sealed it, or None (never)
_KNOWN = ("diffusers.", "diffusers_fastpath.")


class CacheStats:
    """How often a derived value was built (a new table, or a layer that could not reuse it) and reused (another
    layer of the same forward)."""

    __slots__ = ("built", "reused")

    def __init__(self) -> None:
        self.built = 0
        self.reused = 0


def _known(obj) -> bool:
    return type(obj).__module__.startswith(_KNOWN)


def _closed(model: nn.Module) -> bool:
    """Whether, in a forward of `model`, only diffusers' and this package's code can hold what its layers are handed
    (module doc): no hooks below the model, every attention processor and every module of its block lists known.

    Asked at each table's first use, a walk of every module: `hooks_on` of each below the model as its own hooks
    (`own_hooks`) and the global ones asked once, the modules each once as ``model.modules()`` gives them but without
    the names it builds (0.4 ms against 0.9 ms for Bria FIBO 2's 990 modules on a CPU core)."""
    if global_module_hooks():
        return False  # (`hooks_on` of every module below the model)
    todo, seen = [model], {id(model)}
    while todo:
        module = todo.pop()
        if module is not model and own_hooks(module):
            return False
        processor = module.__dict__.get("processor")
        if processor is not None and not (_known(processor) and _known(module)):
            return False
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return all(_known(block) for blocks in model.children() if isinstance(blocks, nn.ModuleList) for block in blocks)


def _sealed(table: torch.Tensor, frame) -> bool:
    """Whether `table` is sealed (module doc) and `frame`, a layer's, runs inside the call of the forward that sealed
    it (a later call, in a frame of the same id or not, is not that call: what that call kept on the table is dropped
    there, rather than carried by a tensor that outlives it, an input the pipeline hands to every step)."""
    seal = table.__dict__.get(_SEAL_ATTR, False)
    if seal is False:  # the table's first use: seal it for this forward, or for good not
        forward = enclosing_model_forward(frame)
        ok = forward is not None and _closed(forward.f_locals["self"])
        seal = table.__dict__[_SEAL_ATTR] = frame_key(forward) if ok else None
        return ok
    if seal is None:
        return False
    if inside(frame, seal):
        return True
    table.__dict__.pop(_DERIVED_ATTR, None)
    return False


def _versions(value) -> tuple:
    """The version counters of the tensors of `value` (a tensor or a tuple of them; ``None`` for an inference
    tensor): a consumer that writes into the shared value must not hand the next layer its own result."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None for t in items)


def forget(tensor: torch.Tensor) -> None:
    """Drop what `derived` kept on `tensor`: its stored values and its seal (module doc). For a tensor handed to
    more than one forward, before each: a CUDA graph's static inputs between the warm-up and the capture, which the
    warm-up's seal would leave unshared in the capture (another call) and which would still carry values computed
    outside the graph. Python only, no device work: safe in a capture."""
    tensor.__dict__.pop(_DERIVED_ATTR, None)
    tensor.__dict__.pop(_SEAL_ATTR, None)


def derived(table: torch.Tensor, key: Hashable, compute: Callable[[], Any], stats: CacheStats | None = None,
            valid: Callable[[Any], bool] | None = None) -> Any:
    """``compute()`` for `table`, computed once per (`table` tensor, `key`) and stored on the tensor itself, for the
    later layers of the call of the forward that sealed the table (module doc); elsewhere computed every time, as
    written.

    `compute` must be a pure function of ``table``'s values (and of `key`). The stored value is also dropped if the
    table, or the value itself, is written in place since (its version counter moved). While ``torch.compile``
    traces, nothing is stored: the graph computes it (the compiler deduplicates). With `valid`, a stored value that it
    refuses (one derived from an input other than the caller's) is computed again and replaces it. Call it from the
    layer's own code: the frame of the caller is the one checked.
    """
    if torch.compiler.is_compiling() or not _sealed(table, sys._getframe(1)):
        if stats is not None:
            stats.built += 1
        return compute()
    version = None if table.is_inference() else table._version
    store = table.__dict__.get(_DERIVED_ATTR)
    if store is None:
        store = table.__dict__[_DERIVED_ATTR] = {}
    entry = store.get(key)
    if (entry is not None and entry[0] == version and _versions(entry[1]) == entry[2]
            and (valid is None or valid(entry[1]))):
        if stats is not None:
            stats.reused += 1
        return entry[1]
    value = compute()
    store[key] = (version, value, _versions(value))
    if stats is not None:
        stats.built += 1
    return value
