"""Rotary values derived once per forward and shared by every layer, owned by the tensor they derive from.

Diffusers builds a transformer's rotary table once per forward (``FluxTransformer2DModel.forward`` calls
``pos_embed(ids)`` once and hands the result to every block), which is exact by construction: this package keeps
that and adds no cache across forwards. What some attention processors still recompute in every layer from that
one table (ERNIE-Image's ``torch.cos``/``torch.sin`` of the angles, for q and for k) is derived here once per table
tensor and stored *on that tensor* (`derived`): the value lives exactly as long as the table, belongs to the forward
that built it (two threads, two forwards, two tables), and needs no key at all.

Why not a cache across denoising steps keyed on the position ids: a key made of tensor identity, ``data_ptr`` and
``_version`` misses writes through ``.data`` or ``.numpy()`` and fails on inference tensors (they have no version
counter), a key taken from the model's arguments misses ids that a hook or a subclass changes before ``pos_embed``
sees them, and a key parked on a module is shared by two threads; a key by value needs a host sync per step. What
such a cache saved is a handful of small kernels per step (`FluxPosEmbed` on FLUX.1-dev's 4608 ids: 6 since
`_pos_embed` builds all axes at once), which CUDA graphs replay at no host cost anyway.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

STATS_PREFIX = "_fastpath_stats_"  # `report` lists every such attribute of a patched model's modules
_DERIVED_ATTR = "_fastpath_derived"


class CacheStats:
    """How often a derived value was built (a new table) and reused (another layer of the same forward)."""

    __slots__ = ("built", "reused")

    def __init__(self) -> None:
        self.built = 0
        self.reused = 0


def derived(table: torch.Tensor, key: Hashable, compute: Callable[[], Any], stats: CacheStats | None = None,
            valid: Callable[[Any], bool] | None = None) -> Any:
    """``compute()`` for `table`, computed once per (`table` tensor, `key`) and stored on the tensor itself.

    `compute` must be a pure function of ``table``'s values (and of `key`). The stored value is dropped if the table
    is written in place since (its version counter moved; inference tensors, which have none, can only be written
    inside ``torch.inference_mode`` by code that holds them: the forward that built them). While ``torch.compile``
    traces, nothing is stored: the graph computes it (the compiler deduplicates). With `valid`, a stored value that
    it refuses (one derived from an input other than the caller's) is computed again and replaces it.
    """
    if torch.compiler.is_compiling():
        return compute()
    version = None if table.is_inference() else table._version
    store = table.__dict__.get(_DERIVED_ATTR)
    if store is None:
        store = table.__dict__[_DERIVED_ATTR] = {}
    entry = store.get(key)
    if entry is not None and entry[0] == version and (valid is None or valid(entry[1])):
        if stats is not None:
            stats.reused += 1
        return entry[1]
    value = compute()
    store[key] = (version, value)
    if stats is not None:
        stats.built += 1
    return value
