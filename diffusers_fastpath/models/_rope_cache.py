"""Rotary embeddings built once per set of positions and reused across denoising steps, with no host sync.

A transformer recomputes its rotary table from position ids in every forward, although a pipeline passes the same
ids (or the same tensors that determine them) at every step. Inside a CUDA graph capture the cache is bypassed
(see `cached`). The patched pos-embed module returns a cached table
while a `ForwardKey`, taken from the transformer forward's own arguments by a pre-hook, matches; the key compares
tensor identity and version counters, never values, so it costs no device synchronisation.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from ..ops._policy import capturing

KEY_ATTR = "_fastpath_forward_key"
CACHE_ATTR = "_fastpath_rope_cache"
STATS_PREFIX = "_fastpath_stats_"  # `report` lists every such attribute of a patched model's modules
ENTRIES = 4  # e.g. a true-CFG run alternates two sets of text ids
_STATS_ATTR = STATS_PREFIX + "rotary_cache"


class CacheStats:
    """How often a cached value was built (new key) and reused (same key, another step or layer)."""

    __slots__ = ("built", "reused")

    def __init__(self) -> None:
        self.built = 0
        self.reused = 0


class ForwardKey:
    """Identity of the inputs a table was built from: the same tensor objects, unmodified, plus static metadata.

    Tensors are held by weak reference (a freed tensor never matches a new one at the same address) and compared
    by identity, version counter (bumped by any in-place write, also through a view), shape, dtype and device.
    """

    __slots__ = ("refs", "meta")

    def __init__(self, tensors: tuple[torch.Tensor, ...], static: tuple = ()) -> None:
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.meta = (static, tuple((t._version, t.data_ptr(), t.shape, t.dtype, t.device) for t in tensors))

    def same(self, other: "ForwardKey") -> bool:
        if self.meta != other.meta:
            return False
        for mine, theirs in zip(self.refs, other.refs):
            t = mine()
            if t is None or t is not theirs():
                return False
        return True


def cached(module: nn.Module, compute: Callable[[], Any]) -> Any:
    """``compute()``, or the value it returned for this forward's key before (see `install`)."""
    if torch.compiler.is_compiling():  # first, so that dynamo never traces the cache's dict operations
        return compute()
    key = module.__dict__.pop(KEY_ATTR, None)
    if key is None:  # called outside a patched forward: compute as diffusers does
        return compute()
    if capturing():
        # In a CUDA graph the table must be computed by the graph itself, from the graph's static position-id
        # buffers: a cached table would be read at its old address on every replay (whatever ids the replay has),
        # and a table built into the graph's memory pool is overwritten by later replays.
        return compute()
    cache: list = module.__dict__[CACHE_ATTR]
    stats: CacheStats = module.__dict__[_STATS_ATTR]
    for i, (cached_key, value) in enumerate(cache):
        if cached_key.same(key):
            if i:
                cache.insert(0, cache.pop(i))
            stats.reused += 1
            return value
    value = compute()
    cache.insert(0, (key, value))
    del cache[ENTRIES:]
    stats.built += 1
    return value


def install(state, model: nn.Module, pos_embed: nn.Module, cls: type, key_of: Callable[[tuple, dict], Any]) -> None:
    """Swap `pos_embed` to `cls` (whose forward calls `cached`) and key it from `model`'s forward arguments.

    ``key_of(args, kwargs)`` returns a `ForwardKey` for a forward call, or None when it cannot tell.
    """
    state.swap_class(pos_embed, cls)
    state.set_attr(pos_embed, CACHE_ATTR, [])
    state.set_attr(pos_embed, _STATS_ATTR, CacheStats())

    def capture(module, args, kwargs):
        if not torch.compiler.is_compiling():
            key = key_of(args, kwargs)
            if key is not None:
                pos_embed.__dict__[KEY_ATTR] = key

    def release(module, args, kwargs, output):
        if not torch.compiler.is_compiling():
            pos_embed.__dict__.pop(KEY_ATTR, None)

    state.add_hook(model.register_forward_pre_hook(capture, with_kwargs=True))
    state.add_hook(model.register_forward_hook(release, with_kwargs=True, always_call=True))


def argument(args: tuple, kwargs: dict, name: str, position: int) -> Any:
    return kwargs[name] if name in kwargs else (args[position] if len(args) > position else None)
