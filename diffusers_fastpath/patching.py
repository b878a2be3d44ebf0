"""Find the transformer(s) of a pipeline or model, apply each model family's adapter, and undo it exactly.

Every change an adapter makes goes through a `PatchState`, which records how to undo it: a ``__class__`` swap
(the live instance keeps its parameters, buffers and attached hooks), an attribute set on a module (fusion-site
counters, caches), an attention processor set through diffusers' ``set_processor``, a forward hook. ``unpatch``
replays the undo log backwards. Nothing module-level in diffusers is ever modified, so other models in the
process are untouched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from . import graphs
from ._logging import logger
from .ops import Site

STATE_ATTR = "_fastpath_state"
SITE_ATTR = "_fastpath_site"  # read directly (``self._fastpath_site``) by the patched forwards
QUALITIES = ("lossless", "high")


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


Adapter = Callable[[nn.Module, "PatchState"], None]
ADAPTERS: dict[type, Adapter] = {}


def register_adapter(model_cls: type) -> Callable[[Adapter], Adapter]:
    """Register ``adapter(model, state)`` as the way to patch instances of ``model_cls`` (and its subclasses)."""

    def decorator(adapter: Adapter) -> Adapter:
        ADAPTERS[model_cls] = adapter
        return adapter

    return decorator


class PatchState:
    """What `patch` did to one model, as an undo log; lives on the model as ``model._fastpath_state``."""

    def __init__(self, quality: str) -> None:
        self.quality = quality
        self.notes: list[str] = []  # things left alone on purpose, with the reason (shown by `report`)
        self._undo: list[Callable[[], None]] = []

    def swap_class(self, module: nn.Module, cls: type) -> None:
        old = type(module)
        module.__class__ = cls

        def undo() -> None:
            if type(module) is cls:
                module.__class__ = old

        self._undo.append(undo)

    def set_attr(self, module: nn.Module, name: str, value: Any) -> None:
        module.__dict__[name] = value
        self._undo.append(lambda: module.__dict__.pop(name, None))

    def add_site(self, module: nn.Module, op: str, name: str | None = None) -> Site:
        """Attach a `Site` (the counters of one fusion site) to `module`: as ``_fastpath_site``, or, for a module
        with several sites, as ``_fastpath_site_<name>`` (`report` shows it as ``<module path>:<name>``)."""
        site = Site(op)
        self.set_attr(module, site_attr(name), site)
        return site

    def set_processor(self, attn: nn.Module, processor: Any) -> None:
        old = attn.processor
        attn.set_processor(processor)

        def undo() -> None:
            if attn.processor is processor:  # a processor the user set since then stays
                attn.set_processor(old)

        self._undo.append(undo)

    def replace_processors(self, model: nn.Module, attention_cls: type, default_cls: type, make: Callable[[], Any]) -> None:
        """Give every ``attention_cls`` module of `model` whose processor is exactly diffusers' `default_cls` a new
        processor from `make()`, carrying over per-instance attention-backend settings; any other processor
        (IP-adapter, a user's own) is left in place and noted for `report`."""
        kept: dict[str, int] = {}
        for module in model.modules():
            if not isinstance(module, attention_cls):
                continue
            old = module.processor
            if type(old) is default_cls:
                new = make()
                for name in ("_attention_backend", "_parallel_config"):  # set per instance by set_attention_backend
                    if name in vars(old):
                        setattr(new, name, getattr(old, name))
                self.set_processor(module, new)
            elif not type(old).__module__.startswith(__package__):
                kept[type(old).__name__] = kept.get(type(old).__name__, 0) + 1
        for name, count in kept.items():
            self.notes.append(f"kept {count} attention processor(s) of type {name} (not diffusers' {default_cls.__name__})")

    def add_hook(self, handle: torch.utils.hooks.RemovableHandle) -> None:
        self.on_undo(handle.remove)

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` when the patch is undone (in reverse order with everything else)."""
        self._undo.append(fn)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def _adapter_for(model: nn.Module) -> Adapter | None:
    for cls in type(model).__mro__:
        if cls in ADAPTERS:
            return ADAPTERS[cls]
    return None


def supported_classes() -> list[str]:
    from . import models  # noqa: F401  (registers the adapters)

    return sorted(cls.__name__ for cls in ADAPTERS)


def _models_of(obj: Any, *, for_patch: bool) -> list[tuple[str, nn.Module]]:
    """The (name, model) pairs `patch`/`unpatch`/`report` act on, with a clear error for anything else."""
    from diffusers import DiffusionPipeline

    from . import models  # noqa: F401  (registers the adapters)

    if isinstance(obj, DiffusionPipeline):
        found = [
            (name, comp)
            for name, comp in obj.components.items()
            if isinstance(comp, nn.Module) and (_adapter_for(comp) is not None or hasattr(comp, STATE_ATTR))
        ]
        if not found and for_patch:
            held = ", ".join(
                f"{name}={type(comp).__name__}" for name, comp in obj.components.items() if isinstance(comp, nn.Module)
            )
            raise ValueError(
                f"diffusers_fastpath: {type(obj).__name__} holds no supported model ({held or 'no models'}). "
                f"Supported: {', '.join(supported_classes())}."
            )
        return found
    if isinstance(obj, nn.Module):
        if isinstance(obj, torch._dynamo.eval_frame.OptimizedModule):
            raise TypeError(
                "diffusers_fastpath: this model is already wrapped by torch.compile; patch the model first, then "
                "compile it (fp.patch(model); model = torch.compile(model))."
            )
        if for_patch and _adapter_for(obj) is None:
            raise TypeError(
                f"diffusers_fastpath does not support {type(obj).__name__}. "
                f"Supported: {', '.join(supported_classes())}."
            )
        return [(type(obj).__name__, obj)]
    raise TypeError(
        f"diffusers_fastpath: expected a diffusers DiffusionPipeline or a model (torch.nn.Module), "
        f"got {type(obj).__name__}."
    )


def _check_quality(quality: str) -> None:
    if quality not in QUALITIES:
        raise ValueError(
            f"diffusers_fastpath: unknown quality tier {quality!r}; available: {', '.join(map(repr, QUALITIES))}."
        )


def patch(obj: Any, quality: str = "lossless", *, cuda_graphs: bool = False) -> Any:
    """Make a diffusers pipeline or model faster with output bit-identical to unpatched diffusers.

    Patches every supported model a pipeline holds (``transformer``, ``transformer_2``, ...) in place: the adaLN
    modules and the blocks around them become state-dict-compatible subclasses whose elementwise chains run as
    fused CUDA kernels that reproduce eager PyTorch's rounding exactly, the rotary embedding is built once per
    set of position ids instead of once per step, and attention runs through a fastpath processor. Inputs the
    kernels cannot take (CPU, fp32, odd strides, autograd) run the eager expressions, so the output is still
    ``torch.equal`` to unpatched diffusers. Patching twice with the same quality changes nothing; patching a
    patched model with another quality makes that its tier (mounting or unmounting the approximate fusions).

    Args:
        obj: a ``DiffusionPipeline`` or a supported model (see `supported_classes`).
        quality: the default tier. ``"lossless"`` (the default): bit-identical to unpatched diffusers. ``"high"``:
            the approximate fusions are mounted too (see `diffusers_fastpath.quality`; PSNR >= 35 dB and
            SSIM >= 0.97 against lossless on the decoded image). ``diffusers_fastpath.quality(obj, tier)`` switches
            tiers for the duration of a ``with`` block.
        cuda_graphs: also capture each model's forward as a CUDA graph per input signature and replay it, which
            removes the host's per-kernel launch cost and stays bit-identical (every graph's first replay is checked
            against eager with ``torch.equal``). Calls a graph cannot stand for run eager, with the reason in
            `report`; on a machine without CUDA it has no effect. See `diffusers_fastpath.graphs`. Asking again
            with ``True`` on a patched model turns graphs on; they go away with `unpatch`.

    Returns:
        ``obj``, patched in place.

    Raises:
        TypeError: ``obj`` is a model of an unsupported class (the message names the supported ones).
        ValueError: the pipeline holds no supported model, or ``quality`` is not a known tier.
        TypeError: ``cuda_graphs`` is not a bool.

    Example:
        >>> import diffusers_fastpath as fp
        >>> pipe = fp.patch(pipe)  # doctest: +SKIP
        >>> image = pipe(prompt).images[0]  # doctest: +SKIP
        >>> print(fp.report(pipe))  # doctest: +SKIP
    """
    from .quality import set_tier

    _check_quality(quality)
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"diffusers_fastpath: cuda_graphs must be True or False, got {cuda_graphs!r}.")
    for name, model in _models_of(obj, for_patch=True):
        state = getattr(model, STATE_ATTR, None)
        if state is not None:
            if state.quality != quality:
                set_tier(name, model, state, quality)  # re-patching with another tier changes the default tier
            if cuda_graphs:
                graphs.install(model, state, name)
            continue
        state = PatchState(quality)
        try:
            _adapter_for(model)(model, state)
        except BaseException:
            state.undo()
            raise
        model.__dict__[STATE_ATTR] = state
        if cuda_graphs:
            graphs.install(model, state, name)
        sites = sum(len(sites_of(m)) for m in model.modules())
        logger.info(f"diffusers_fastpath: patched {name} ({type(model).__name__}): {sites} fused sites, quality={quality}")
        set_tier(name, model, state, quality)  # mounts the high-tier sites if asked; checks every site's fitness
    return obj


def unpatch(obj: Any) -> Any:
    """Restore every class, attention processor and hook that `patch` changed; a no-op for unpatched objects.

    Args:
        obj: the pipeline or model given to `patch`.

    Returns:
        ``obj``, restored in place.

    Example:
        >>> fp.unpatch(pipe)  # doctest: +SKIP
    """
    for _, model in _models_of(obj, for_patch=False):
        state = model.__dict__.pop(STATE_ATTR, None)
        if state is not None:
            state.undo()
    return obj


def patched_models(obj: Any) -> list[tuple[str, nn.Module, PatchState]]:
    return [
        (name, model, model.__dict__[STATE_ATTR])
        for name, model in _models_of(obj, for_patch=False)
        if STATE_ATTR in model.__dict__
    ]
