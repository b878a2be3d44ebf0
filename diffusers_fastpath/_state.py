"""What a patch did to one model, as data: the undo log, the fusion-site marks, the quality tiers, the adapter registry.

This module is the one owner of the state that `patching` (the public ``patch``/``unpatch``), `quality` (the tiers
and their sites) and the adapters in `models` share; it imports none of them, so the package's imports form a
DAG: ``_state`` <- ``quality`` <- ``models`` <- ``patching``.

The undo log is a list of plain records (tuples naming the module and what to restore), not closures, so that a
patched model stays an ordinary module to everything that copies it: `copy.deepcopy` maps every module a record
names through its memo onto the copy (each copy then unpatches on its own), and `pickle`/`torch.save` store the
records with the model and load them patched (every class a record names is a module-level class).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from .ops import Site
from .ops._policy import forward_replaced

STATE_ATTR = "_fastpath_state"
SITE_ATTR = "_fastpath_site"  # read directly (``self._fastpath_site``) by the patched forwards
QUALITIES = ("lossless", "high")
REPEATED_BLOCKS_ATTR = "_repeated_blocks"  # ModelMixin's class-name list behind compile_repeated_blocks

# Per-instance attention-backend settings that diffusers' ``set_attention_backend``/``reset_attention_backend``
# (and context parallelism) write on a processor; the class default of each is None.
BACKEND_ATTRS = ("_attention_backend", "_parallel_config")

_MISSING = object()


def bound_safe(cls: type) -> None:
    """Make `cls`'s own ``forward`` (a patched class's) run the forward of the class its object has *now* wherever
    that object is no longer a `cls`: a hook added after `patch` (diffusers' group offloading, layerwise casting)
    holds the bound patched forward, which putting the object's class back (`unpatch`, and the verification's run as
    diffusers wrote it: `verify.as_written`) does not reach; and run the forward of its parent class wherever a
    ``forward`` of the classes it inherits is no longer the one written there (`forward_replaced`: a library replaced
    ``RMSNorm.forward`` on diffusers' class: the fused forward would skip the replacement), or, for a class whose
    forward was rewritten from its parent's (``_fastpath_made_from``: that function), where the parent's is another
    one since (rewritten again at the next `patch`). Once per
    class (a flag on it). The rewriter's classes (`_chains.fused_subclass`, ``_fastpath_rewrite`` in their dict) are
    left as they are: their rewritten forwards ask the same themselves (`_chains._stale_check`)."""
    if cls.__dict__.get("_fastpath_bound_safe") or "_fastpath_rewrite" in cls.__dict__:
        return
    fn = cls.__dict__.get("forward")
    if fn is not None and not getattr(fn, "_fastpath_bound_safe", False):
        wrapper = _bound_safe_forward(cls, fn)
        # a code object of its own per class: torch.compile keeps its cache and its recompile limit per code object,
        # so one shared code would make every patched block class (FLUX's dual and single blocks, at each shape)
        # spend one budget (`compile_repeated_blocks(fullgraph=True)` failed at a third resolution)
        wrapper.__code__ = wrapper.__code__.replace(co_name="forward", co_qualname=f"{cls.__qualname__}.forward")
        BOUND_SAFE_CODES[id(wrapper.__code__)] = wrapper.__code__
        forward = functools.wraps(fn)(wrapper)
        forward._fastpath_bound_safe = True
        cls.forward = forward
    cls._fastpath_bound_safe = True


def _bound_safe_forward(cls: type, fn: Callable) -> Callable:
    def forward(self, *args, **kwargs):
        if not isinstance(self, cls):  # unpatched, reached through a hook's bound method: what its class runs
            return type(self).forward(self, *args, **kwargs)
        made_from = getattr(cls, "_fastpath_made_from", None)  # (a forward rewritten from its parent's, if so)
        if forward_replaced(self) if made_from is None else cls.__mro__[1].forward is not made_from:
            return super(cls, self).forward(*args, **kwargs)  # what the parent class runs now
        return fn(self, *args, **kwargs)

    return forward


def call_safe(cls: type) -> None:
    """Make this package's attention processor class `cls` run its parent's ``__call__`` wherever that is no longer
    the function it held when `cls` was first given to a model: one replaced on diffusers' class after `patch`
    (cache-dit's context-parallel planners replace ``WanAttnProcessor.__call__``) runs, not the fused mirror of the
    old one. Once per class (a flag on it); the rewriter's classes ask the same themselves (`_chain_calls.stale`).
    (`bound_safe`'s twin for processors: a processor is no module, so `forward_replaced` does not read it.)"""
    if cls.__dict__.get("_fastpath_call_safe") or "_fastpath_rewrite" in cls.__dict__:
        return
    fn, parent = cls.__dict__.get("__call__"), cls.__mro__[1]
    if fn is not None:
        checked = parent.__call__

        def __call__(self, *args, **kwargs):
            if parent.__call__ is not checked:  # replaced on diffusers' class since: what it holds now
                return parent.__call__(self, *args, **kwargs)
            return fn(self, *args, **kwargs)

        cls.__call__ = functools.wraps(fn)(__call__)
    cls._fastpath_call_safe = True


# the code of every `bound_safe` wrapper (one per class), by its id: a frame of it stands between a module call and the
# patched forward it runs (`models._driver` counts it as part of the module call, by identity)
BOUND_SAFE_CODES: dict = {}


def site_attr(name: str | None = None) -> str:
    """The attribute that holds a module's site named `name` (``None``: its one unnamed site)."""
    return SITE_ATTR if name is None else f"{SITE_ATTR}_{name}"


def sites_of(module: nn.Module) -> list[tuple[str | None, Site]]:
    """The fusion sites attached to `module` by `PatchState.add_site`, as ``(name or None, site)``."""
    return [
        (None if attr == SITE_ATTR else attr[len(SITE_ATTR) + 1 :], value)
        for attr, value in module.__dict__.items()
        if isinstance(value, Site)
    ]


def _check_quality(quality: str) -> None:
    if quality not in QUALITIES:
        raise ValueError(
            f"diffusers_fastpath: unknown quality tier {quality!r}; available: {', '.join(map(repr, QUALITIES))}."
        )


Adapter = Callable[[nn.Module, "PatchState"], None]
ADAPTERS: dict[type, Adapter] = {}


def register_adapter(model_cls: type) -> Callable[[Adapter], Adapter]:
    """Register ``adapter(model, state)`` as the way to patch instances of ``model_cls`` (and its subclasses)."""

    def decorator(adapter: Adapter) -> Adapter:
        ADAPTERS[model_cls] = adapter
        return adapter

    return decorator


# --- diffusers' block and processor registries -----------------------------------------------------------------


def register_like(registry: Any, base: type, cls: type) -> bool:
    """Register our subclass `cls` in a diffusers class registry (``TransformerBlockRegistry``,
    ``AttentionProcessorRegistry``) with the metadata of `base`, the diffusers class it was swapped in for, if `base`
    is registered there.

    diffusers looks those registries up by exact class (``registry.get(module.__class__)``: first-block cache,
    MagCache, SeaCache, layer skip), so a swapped class must be registered itself. The registration is additive: a
    copy of the base's metadata under our own class (``register`` sets the copy's ``_cls``, whose ``forward``
    signature is the mirrored one); diffusers' own entries are never modified. Returns whether `cls` is registered.
    """
    try:
        registry.get(cls)
        return True
    except ValueError:
        pass
    try:
        metadata = registry.get(base)
    except ValueError:
        return False
    fields = {f.name for f in dataclasses.fields(metadata)}
    reset = {name: None for name in ("_cls", "_cached_parameter_indices") if name in fields}
    registry.register(cls, dataclasses.replace(metadata, **reset))
    return True


def _block_registry():
    from diffusers.hooks._helpers import TransformerBlockRegistry

    return TransformerBlockRegistry


def _processor_registry():
    from diffusers.hooks._helpers import AttentionProcessorRegistry

    return AttentionProcessorRegistry


# --- the undo log ---------------------------------------------------------------------------------------------
#
# Records, replayed backwards by `PatchState.undo`:
#   ("class", module, old_cls, new_cls)            module.__class__ = old_cls, if it is still new_cls
#   ("layer", module, name, token)                 the value set under `token` taken out of module.__dict__[name]'s
#                                                  layers (below)
#   ("attr", module, name[, old_value])            module.__dict__[name] put back (or removed, if it was absent): the
#                                                  form before layers, still undone when a model pickled then loads
#   ("processor", attn, old, new)                  attn.set_processor(old), if it is still new, with the backend
#                                                  settings made on `new` since then carried over to `old`
#   ("hook", handle)                               handle.remove() (a torch RemovableHandle)
#   ("call", fn, args)                             fn(*args): fn a module-level function or a bound method, so
#                                                  that it pickles by reference and deepcopy maps its object


def _undo_class(module: nn.Module, old: type, new: type) -> None:
    cls = type(module)
    if cls is new:
        module.__class__ = old
    elif cls.__bases__ == (new,) and parametrize.is_parametrized(module):
        # a parametrization registered after `patch` made the module an instance of torch's ``Parametrized<new>``
        # (its parametrized tensors as properties): the same class over `old`, which torch's removal unwraps to `old`
        body = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
        module.__class__ = type(cls.__name__.replace(new.__name__, old.__name__), (old,), body)


def _undo_attr(module: nn.Module, name: str, *old: Any) -> None:
    if old:
        module.__dict__[name] = old[0]
    else:
        module.__dict__.pop(name, None)


# An attribute set by `PatchState.set_attr` keeps its layers on the module itself, in ``module.__dict__[LAYERS_ATTR]``:
# ``{name: [original, [(token, value), ...]]}``, ``original`` ``(value,)`` or ``()`` where the name was absent, the
# list oldest first. Two models that share modules (the same blocks in two transformers) each set attributes on them
# over the other's: B's patch finds A's value there. Undoing a layer takes out just that layer; the attribute shows
# the newest layer left, or the original once none is left, and the layers go with the last one. So any order of
# unpatching leaves the module as it was; an undo log that put back "what was there" would put back A's value when
# A was unpatched first. The layers live on the module, so `copy.deepcopy` and `pickle` carry them with it.
LAYERS_ATTR = "_fastpath_layers"


def _undo_layer(module: nn.Module, name: str, token: object) -> None:
    layers = module.__dict__.get(LAYERS_ATTR) or {}
    entry = layers.get(name)
    stack = entry[1] if entry is not None else ()
    index = next((i for i, (t, _) in enumerate(stack) if t is token), None)
    if index is None:
        return
    del stack[index]
    if index == len(stack):  # the newest layer: show the one below it (under a newer layer, the newer one stays)
        if stack:
            module.__dict__[name] = stack[-1][1]
        elif entry[0]:
            module.__dict__[name] = entry[0][0]
        else:
            module.__dict__.pop(name, None)
    if not stack:
        del layers[name]
        if not layers:
            del module.__dict__[LAYERS_ATTR]


def carry_backend(source: Any, target: Any) -> None:
    """Give `target` the per-instance attention-backend settings of `source` (each present or absent as there)."""
    for name in BACKEND_ATTRS:
        value = vars(source).get(name, _MISSING) if hasattr(source, "__dict__") else _MISSING
        if value is _MISSING:
            if hasattr(target, "__dict__"):
                vars(target).pop(name, None)
        else:
            setattr(target, name, value)


def _undo_processor(attn: nn.Module, old: Any, new: Any) -> None:
    if attn.processor is new:  # a processor the user set since then stays
        # set_attention_backend / reset_attention_backend while patched wrote on `new`: keep what they chose
        carry_backend(new, old)
        attn.set_processor(old)


def _undo_hook(handle: torch.utils.hooks.RemovableHandle) -> None:
    handle.remove()


def _undo_call(fn: Callable[..., None], args: tuple) -> None:
    fn(*args)


_UNDO = {"class": _undo_class, "layer": _undo_layer, "attr": _undo_attr, "processor": _undo_processor, "hook": _undo_hook, "call": _undo_call}


class PatchState:
    """What `patch` did to one model, as an undo log of records; lives on the model as ``model._fastpath_state``.

    Also the model's quality tier: the default given to `patch` and a stack of the requests of the
    `diffusers_fastpath.quality` contexts active on this model; `quality` reads the effective tier.

    Attributes:
        notes: things left alone on purpose, with the reason (shown by `report`).
        default_quality: the tier given to `patch` (re-patching with another tier changes it).
    """

    def __init__(self, quality: str) -> None:
        self.default_quality = quality
        self.notes: list[str] = []
        self.records: list[tuple] = []
        self._requests: list[tuple[object, str]] = []  # (token, tier) of active quality contexts, oldest first
        self.lock = threading.RLock()  # taken by `quality` around a request and the mounting it causes

    # --- the tier -------------------------------------------------------------------------------------------
    @property
    def quality(self) -> str:
        """The effective tier: the newest active `diffusers_fastpath.quality` request, else the default."""
        requests = self._requests
        return requests[-1][1] if requests else self.default_quality

    @quality.setter
    def quality(self, tier: str) -> None:
        """Assigning sets the default tier (what the model runs at when no `quality` request is active)."""
        _check_quality(tier)
        self.default_quality = tier

    def push_quality(self, tier: str) -> object:
        """Record a request for `tier` (newest wins) and return its token for `pop_quality`."""
        token = object()
        with self.lock:
            self._requests.append((token, tier))
        return token

    def pop_quality(self, token: object) -> None:
        """Remove the request of `token`, wherever it is in the stack (contexts may exit out of order)."""
        with self.lock:
            self._requests = [r for r in self._requests if r[0] is not token]

    # --- recording changes ----------------------------------------------------------------------------------
    def swap_class(self, module: nn.Module, cls: type) -> None:
        """Make `module` an instance of `cls` (a subclass of its class), and register `cls` in diffusers' block
        registry like its base class if that is registered (caches and layer skip look blocks up by exact class)."""
        old = type(module)
        bound_safe(cls)
        module.__class__ = cls
        self.records.append(("class", module, old, cls))
        register_like(_block_registry(), old, cls)

    def set_attr(self, module: nn.Module, name: str, value: Any) -> None:
        """Set ``module.__dict__[name]`` as a new layer of it (see `LAYERS_ATTR`); undo takes out that layer, and
        the module shows what was there before once every patch that set it is undone, in any order."""
        attrs = module.__dict__
        layers = attrs.get(LAYERS_ATTR)
        if layers is None:
            layers = attrs[LAYERS_ATTR] = {}
        if name not in layers:
            layers[name] = [(attrs[name],) if name in attrs else (), []]
        token = object()  # pickles and deep-copies with the model, one object for the record and the layer
        layers[name][1].append((token, value))
        attrs[name] = value
        self.records.append(("layer", module, name, token))

    def add_site(self, module: nn.Module, op: str, name: str | None = None) -> Site:
        """Attach a `Site` (the counters of one fusion site) to `module`: as ``_fastpath_site``, or, for a module
        with several sites, as ``_fastpath_site_<name>`` (`report` shows it as ``<module path>:<name>``)."""
        site = Site(op)
        self.set_attr(module, site_attr(name), site)
        return site

    def set_processor(self, attn: nn.Module, processor: Any) -> None:
        """``attn.set_processor(processor)``, and register the processor's class in diffusers' processor registry
        like the one it replaces (layer skip looks processors up by exact class)."""
        old = attn.processor
        attn.set_processor(processor)
        self.records.append(("processor", attn, old, processor))
        register_like(_processor_registry(), type(old), type(processor))

    def replace_processors(self, model: nn.Module, attention_cls: type, default_cls: type, make: Callable[[], Any],
                           where: Callable[[nn.Module], bool] | None = None) -> None:
        """Give every ``attention_cls`` module of `model` (those `where` accepts, if given) whose processor is exactly
        diffusers' `default_cls` a new processor from `make()`, carrying over per-instance attention-backend settings;
        any other processor (IP-adapter, a user's own) is left in place and noted for `report`."""
        kept: dict[str, int] = {}
        for module in model.modules():
            if not isinstance(module, attention_cls) or (where is not None and not where(module)):
                continue
            old = module.processor
            if type(old) is default_cls:
                new = make()
                call_safe(type(new))
                carry_backend(old, new)  # set per instance by set_attention_backend
                self.set_processor(module, new)
            elif not type(old).__module__.startswith(__package__):
                kept[type(old).__name__] = kept.get(type(old).__name__, 0) + 1
        for name, count in kept.items():
            self.notes.append(f"kept {count} attention processor(s) of type {name} (not diffusers' {default_cls.__name__})")

    def add_hook(self, handle: torch.utils.hooks.RemovableHandle) -> None:
        """Remove the hook of `handle` on undo."""
        self.records.append(("hook", handle))

    def on_undo(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` when the patch is undone (in reverse order with everything else).

        `fn` must be a module-level function or a bound method (it is stored by reference: a closure would neither
        pickle nor follow a `copy.deepcopy` of the model); pass the modules it acts on in `args`.
        """
        if "<locals>" in getattr(fn, "__qualname__", ""):
            raise TypeError(
                f"diffusers_fastpath: PatchState.on_undo needs a module-level function or a bound method, not the "
                f"local {fn.__qualname__} (it could not be pickled or follow copy.deepcopy)"
            )
        self.records.append(("call", fn, args))

    def name_repeated_blocks(self, model: nn.Module) -> None:
        """Where `model` lists its repeated block classes by name (``_repeated_blocks``, read by diffusers'
        ``compile_repeated_blocks``), add the names of the subclasses swapped in for them, as an instance attribute
        recorded in the undo log, so that regional compilation finds the patched blocks."""
        names = list(getattr(model, REPEATED_BLOCKS_ATTR, None) or ())
        added = []
        for record in self.records:
            if record[0] == "class" and record[2].__name__ in names:
                new = record[3].__name__
                if new not in names and new not in added:
                    added.append(new)
        if added:
            self.set_attr(model, REPEATED_BLOCKS_ATTR, [*names, *added])

    def undo(self) -> None:
        """Replay the undo log backwards (each record once)."""
        while self.records:
            kind, *args = self.records.pop()
            _UNDO[kind](*args)

    # --- copies ---------------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle) is governed by no quality context: it keeps the tier it was copied at as its
        # default, which is also what its mounted sites say. The lock is per object.
        state = dict(self.__dict__)
        state["default_quality"] = self.quality
        state["_requests"] = []
        del state["lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()
        # In a fresh process diffusers' registries know nothing of our classes yet: register them again.
        for record in self.records:
            if record[0] == "class":
                register_like(_block_registry(), record[2], record[3])
            elif record[0] == "processor":
                register_like(_processor_registry(), type(record[2]), type(record[3]))


# --- what patch/unpatch/report act on ---------------------------------------------------------------------------


_COMPILED_FIRST = ("diffusers_fastpath: {what} is already wrapped by torch.compile; patch the model first, then "
                   "compile it (fp.patch(model); model = torch.compile(model)).")


def _compiled_model(module: Any) -> nn.Module | None:
    """The model inside a ``torch.compile`` wrapper, or None for anything else."""
    return module._orig_mod if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) else None


def is_pipeline(obj: Any) -> bool:
    """Whether `obj` is a diffusers pipeline: a ``DiffusionPipeline``, or a ``ModularPipeline`` (FLUX.3's only
    pipeline is one), whose ``components`` names its models as a ``DiffusionPipeline``'s does."""
    from diffusers import DiffusionPipeline, ModularPipeline

    return isinstance(obj, (DiffusionPipeline, ModularPipeline))


def compiled_unpatched(obj: Any) -> None:
    """Raise the model's error for a model, or a pipeline component, compiled before `patch`: patching the model
    inside the wrapper would change what it already traced."""
    if is_pipeline(obj):
        for name, comp in obj.components.items():
            inner = _compiled_model(comp)
            if inner is not None and STATE_ATTR not in inner.__dict__:
                raise TypeError(_COMPILED_FIRST.format(what=f"{type(obj).__name__}.{name}"))
    else:
        inner = _compiled_model(obj)
        if inner is not None and STATE_ATTR not in inner.__dict__:
            raise TypeError(_COMPILED_FIRST.format(what="this model"))


def models_in(obj: Any) -> list[tuple[str, nn.Module]]:
    """The ``(name, model)`` candidates of a pipeline (its ``nn.Module`` components) or a model, with a clear error
    for anything else."""
    if is_pipeline(obj):
        # a component compiled after `patch` (``pipe.transformer = torch.compile(pipe.transformer)``): its model, which
        # `unpatch`, `report` and `quality` act on (`patch` refuses one compiled before: `compiled_unpatched`)
        # one model held twice (Wan 2.2 with one expert as both `transformer` and `transformer_2`): once, both names
        named: dict[int, tuple[str, nn.Module]] = {}
        for name, comp in obj.components.items():
            if isinstance(comp, nn.Module):
                model = _compiled_model(comp) or comp
                seen = named.get(id(model))
                named[id(model)] = (f"{seen[0]}/{name}" if seen else name, model)
        return list(named.values())
    if isinstance(obj, nn.Module):
        obj = _compiled_model(obj) or obj  # (patched, then compiled: its model; `patch` refuses it compiled first)
        return [(type(obj).__name__, obj)]
    raise TypeError(
        f"diffusers_fastpath: expected a diffusers DiffusionPipeline or ModularPipeline, or a model "
        f"(torch.nn.Module), got {type(obj).__name__}."
    )


def undo_patch(model: nn.Module) -> None:
    """Undo `model`'s patch, if it has one: its state leaves the model, then its undo log is replayed. A processor of
    this package that diffusers saved to put back later (``fuse_qkv_projections`` keeps the processors it replaces in
    the model's ``original_attn_processors``, which ``unfuse_qkv_projections`` sets again) is swapped there too for
    the one it replaced, so that unfusing after `unpatch` gives diffusers' processors back, not this package's."""
    state = model.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return
    replaced = {id(r[3]): r[2] for r in state.records if r[0] == "processor"}
    state.undo()
    if not replaced:
        return
    for module in model.modules():
        saved = module.__dict__.get("original_attn_processors")
        if isinstance(saved, dict):
            for key, processor in list(saved.items()):
                old = replaced.get(id(processor))
                if old is not None:
                    saved[key] = old


def patched_models(obj: Any) -> list[tuple[str, nn.Module, PatchState]]:
    """``(name, model, state)`` for every patched model of a pipeline, or of a model itself."""
    return [(name, model, model.__dict__[STATE_ATTR]) for name, model in models_in(obj) if STATE_ATTR in model.__dict__]
