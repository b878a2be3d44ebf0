"""Find the transformer(s) of a pipeline or model, apply each model family's adapter, and undo it exactly.

Every change an adapter makes goes through a `PatchState` (`diffusers_fastpath._state`), which records how to undo
it as data: a ``__class__`` swap (the live instance keeps its parameters, buffers and attached hooks), an attribute
set on a module (fusion-site counters, caches), an attention processor set through diffusers' ``set_processor``, a
forward hook. ``unpatch`` replays the undo log backwards. Nothing module-level in diffusers is modified (our own
subclasses are added to diffusers' block and processor registries, beside the classes they derive from), so other
models in the process are untouched. A patched model deep-copies into an independently patched copy, and pickles
(``torch.save``) and loads patched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import graphs, postprocess
from . import models  # noqa: F401  (registers the adapters)
from ._logging import logger, warn_once
from ._state import (  # noqa: F401  (PatchState, SITE_ATTR, QUALITIES, ... stay importable from here)
    ADAPTERS,
    QUALITIES,
    SITE_ATTR,
    STATE_ATTR,
    Adapter,
    PatchState,
    _check_quality,
    compiled_unpatched,
    is_pipeline,
    models_in,
    patched_models,
    register_adapter,
    site_attr,
    sites_of,
    undo_patch,
)
from .models import generic
from .ops._policy import FP32_OPS
from .quality import set_tier


def _adapter_for(model: nn.Module) -> Adapter | None:
    for cls in type(model).__mro__:
        if cls in ADAPTERS:
            return ADAPTERS[cls]
    return None


def _patchable(model: nn.Module) -> bool:
    """Whether `patch` takes `model`: a family adapter, or the generic path (`models.generic.eligible`)."""
    return _adapter_for(model) is not None or generic.eligible(model) is None


def coverage() -> list[tuple[str, str, str]]:
    """How `patch` takes each model class diffusers ships: ``(class name, how, detail)`` with ``how`` one of
    ``"family"`` (an adapter written and tested for that family, named in ``detail``), ``"generic"`` (patched from
    its own code by `diffusers_fastpath.models.generic` and verified bit for bit on its first forward per input
    signature) or ``"none"`` (``detail`` says why). A generic class without repeated transformer blocks in a given
    model is refused at `patch` with that reason.

    Example:
        >>> import diffusers_fastpath as fp
        >>> dict((c, how) for c, how, _ in fp.coverage())["WanVACETransformer3DModel"]
        'generic'
    """
    return generic.coverage()


def supported_classes() -> list[str]:
    """The names of the diffusers model classes `patch` supports, sorted.

    A pipeline is supported when it holds at least one of them (``transformer``, ``transformer_2``, ...); a
    subclass of a supported class is patched as that class.

    Returns:
        e.g. ``["BriaFiboTransformer2DModel", ..., "FluxTransformer2DModel", ..., "WanTransformer3DModel"]``.

    Example:
        >>> import diffusers_fastpath as fp
        >>> "FluxTransformer2DModel" in fp.supported_classes()
        True
    """
    return sorted(cls.__name__ for cls in ADAPTERS)


class UnsupportedModelError(TypeError, ValueError):
    """`patch` was given a model of a class it does not support, or a pipeline that holds none.

    One error for both cases. It derives from ``TypeError`` (what an unsupported model raised before) and from
    ``ValueError`` (what a pipeline without a supported model raised), so code written against either still
    catches it.
    """


def _unet_note(modules: list[tuple[str, nn.Module]]) -> str:
    """For a UNet (Stable Diffusion 1.x/2.x, SDXL, ...): why this package does not take it."""
    unets = [f"{name}={type(m).__name__}" for name, m in modules if "UNet" in type(m).__name__]
    if not unets:
        return ""
    return (f" UNets ({', '.join(unets)}) are not what this package patches: it fuses the chains of diffusion "
            "transformers (DiT), and a UNet pipeline runs unchanged.")


def _say_unet_runs_unpatched(obj: Any, found: list[tuple[str, nn.Module]]) -> None:
    """A UNet pipeline whose VAE `patch` takes (Stable Diffusion 1.x/2.x, SDXL hold an ``AutoencoderKL``): patching it
    is not refused (the decode and encode run fused, exactly), but the UNet runs as diffusers wrote it: say so,
    once per pipeline class."""
    if not is_pipeline(obj):
        return
    note = _unet_note([(name, m) for name, m in models_in(obj) if not any(m is f for _, f in found)])
    if note:
        patched = ", ".join(f"{name} ({type(m).__name__})" for name, m in found)
        warn_once(f"diffusers_fastpath: {type(obj).__name__}: only {patched} is patched.{note}")


def _models_of(obj: Any, *, for_patch: bool = True) -> list[tuple[str, nn.Module]]:
    """The (name, model) pairs `patch` acts on (``for_patch``: with a clear error for an unsupported object), or
    those a pipeline holds that `patch` could act on or did."""
    candidates = models_in(obj)
    if is_pipeline(obj):
        found = [(name, comp) for name, comp in candidates if _patchable(comp) or hasattr(comp, STATE_ATTR)]
        if not found and for_patch:
            held = ", ".join(f"{name}={type(comp).__name__}" for name, comp in candidates)
            raise UnsupportedModelError(
                f"diffusers_fastpath: {type(obj).__name__} holds no supported model ({held or 'no models'})."
                f"{_unet_note(candidates)} Supported: {', '.join(supported_classes())}."
            )
        return found
    if for_patch and not (_patchable(obj) or hasattr(obj, STATE_ATTR)):  # (patched already: its blocks are ours)
        raise UnsupportedModelError(
            f"diffusers_fastpath does not support {type(obj).__name__} ({generic.eligible(obj)}).{_unet_note(candidates)} "
            f"Supported: {', '.join(supported_classes())}, and any other diffusers transformer with repeated blocks "
            "(the generic path; fp.coverage() lists them)."
        )
    return candidates


_HALF = (torch.bfloat16, torch.float16)


def _on_cuda(model: nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())


def _say_if_nothing_can_run_fused(name: str, model: nn.Module) -> None:
    """The fused kernels take bf16 and fp16 only: a model whose floating-point weights are all fp32 (or fp64) runs
    diffusers' eager expressions at every site (the same numbers, no speed-up). Say so when it is patched, not
    only in `report`: a warning, once per process, where the model is on a CUDA device (where it could have been
    fast); on a CPU, where no kernel runs anyway, an info line. Weights stored in other dtypes (fp8 layerwise
    casting, quantized backends) compute in bf16 and are not meant here. Nothing is said of an fp32 model with
    sites of the ops that take fp32 too (a VAE's convolution bias adds, buffers and upsampling: `FP32_OPS`), whose
    fp32 sites run fused."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes or dtypes & set(_HALF) or not dtypes <= {torch.float32, torch.float64}:
        return
    if torch.float64 not in dtypes and any(site.op in FP32_OPS for m in model.modules() for _, site in sites_of(m)):
        return
    held = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    msg = (f"diffusers_fastpath: {name} ({type(model).__name__}) has {held} weights; the fused kernels take bfloat16 "
           "and float16 only, so every fused site runs diffusers' eager expression (the same numbers, no speed-up). "
           "Load it with torch_dtype=torch.bfloat16 (or float16) for the fast path.")
    if _on_cuda(model):
        warn_once(msg)
    else:
        logger.info(msg)


def patch(obj: Any, quality: str = "lossless", *, cuda_graphs: bool = False, verify: bool | None = None) -> Any:
    """Make a diffusers pipeline or model faster with output bit-identical to unpatched diffusers.

    Patches every supported model a pipeline holds (``transformer``, ``transformer_2``, ...) in place: the adaLN
    modules and the blocks around them become state-dict-compatible subclasses whose elementwise chains run as
    fused CUDA kernels that reproduce eager PyTorch's rounding exactly, the rotary embedding is built once per
    set of position ids instead of once per step, and attention runs through a fastpath processor. Inputs the
    kernels cannot take (CPU, fp32, odd strides, autograd) run the eager expressions, so the output is still
    ``torch.equal`` to unpatched diffusers. Patching twice with the same quality changes nothing; patching a
    patched model with another quality makes that its tier (mounting or unmounting the approximate fusions).

    Args:
        obj: a ``DiffusionPipeline`` or ``ModularPipeline``, or a supported model (see `supported_classes`).
        quality: the default tier. ``"lossless"`` (the default): bit-identical to unpatched diffusers. ``"high"``:
            the approximate fusions are mounted too (see `diffusers_fastpath.quality`; PSNR >= 35 dB and
            SSIM >= 0.97 against lossless on the decoded image). ``diffusers_fastpath.quality(obj, tier)`` switches
            tiers for the duration of a ``with`` block; the default is the tier when no such block is active (patching
            again with another quality changes it, also under an active block).
        cuda_graphs: also capture each model's forward as a CUDA graph per input signature and replay it, which
            removes the host's per-kernel launch cost and stays bit-identical (every graph's first replay is checked
            against eager with ``torch.equal``). Calls a graph cannot stand for run eager, with the reason in
            `report`; on a machine without CUDA it has no effect. See `diffusers_fastpath.graphs`. Asking again
            with ``True`` on a patched model turns graphs on; they go away with `unpatch`.
        verify: for a model no family adapter covers (patched by the generic path, `models.generic`), run the first
            forward of each input signature both ways and compare them bit for bit before trusting it (one extra
            forward per signature; a mismatch unpatches the model with a warning; `diffusers_fastpath.verify`).
            ``None`` (the default): on, unless ``DIFFUSERS_FASTPATH_VERIFY=0``. Family adapters are verified by
            their tests and need no such check. Asking again with ``True`` on a model patched without it turns it
            on; once on, it stays on until `unpatch`.

    Returns:
        ``obj``, patched in place. A patched model stays an ordinary module: ``copy.deepcopy`` gives an independently
        patched copy (its own undo log and counters; each unpatches on its own), and ``pickle``/``torch.save`` store
        it patched: it loads patched (CUDA graphs are captured again on demand) and `unpatch` restores it there.

    Raises:
        UnsupportedModelError: ``obj`` is a model of an unsupported class, or a pipeline that holds no supported
            model (the message names the supported classes, and says so for a UNet). It is both a ``TypeError`` and
            a ``ValueError``.
        ValueError: ``quality`` is not a known tier.
        TypeError: ``obj`` is neither a pipeline nor a model, or ``cuda_graphs`` is not a bool, or a model (or a
            pipeline's component) is already wrapped by ``torch.compile`` (patch first, then compile).

    A model whose floating-point weights are all fp32 is patched too, and runs diffusers' eager expressions (the
    kernels take bf16 and fp16): a warning says so when it is on a CUDA device. An fp32 VAE (Wan's model card loads
    one) runs its convolutions' bias adds, padded inputs and upsampling fused, its norms as diffusers wrote them.

    Example:
        >>> import diffusers_fastpath as fp
        >>> pipe = fp.patch(pipe)  # doctest: +SKIP
        >>> image = pipe(prompt).images[0]  # doctest: +SKIP
        >>> print(fp.report(pipe))  # doctest: +SKIP
    """
    _check_quality(quality)
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"diffusers_fastpath: cuda_graphs must be True or False, got {cuda_graphs!r}.")
    if verify is not None and not isinstance(verify, bool):
        raise TypeError(f"diffusers_fastpath: verify must be True, False or None, got {verify!r}.")
    compiled_unpatched(obj)
    found = _models_of(obj)
    _say_unet_runs_unpatched(obj, found)
    for name, model in found:
        state = getattr(model, STATE_ATTR, None)
        if state is not None:
            if state.default_quality != quality:
                with state.lock:  # re-patching with another tier changes the default tier
                    state.default_quality = quality
                    set_tier(name, model, state)
            generic.verify_again(model, state, name, verify)  # (a no-op for a model a family adapter patched)
            if cuda_graphs and _graphs_serve(model):
                graphs.install(model, state, name)
            continue
        state = PatchState(quality)
        try:
            adapter = _adapter_for(model)
            if adapter is None:
                generic.patch_generic(model, state, name, verify)
            else:
                adapter(model, state)
            state.name_repeated_blocks(model)
        except BaseException:
            state.undo()
            raise
        model.__dict__[STATE_ATTR] = state
        if cuda_graphs and _graphs_serve(model):
            graphs.install(model, state, name)
        sites = sum(len(sites_of(m)) for m in model.modules())
        logger.info(f"diffusers_fastpath: patched {name} ({type(model).__name__}): {sites} fused sites, quality={quality}")
        _say_if_nothing_can_run_fused(name, model)
        set_tier(name, model, state)  # mounts the high-tier sites if asked; checks every site's fitness
    if is_pipeline(obj):
        _install_postprocess(obj)
    return obj


def _install_postprocess(pipe: Any) -> None:
    """The pinned host copy of a video pipeline's ``postprocess_video`` (`diffusers_fastpath.postprocess`); a
    failure to install it (a pipeline whose attributes cannot be read) leaves the pipeline as it is."""
    try:
        postprocess.install(pipe)
    except Exception as exc:  # noqa: BLE001 - the models are patched; post-processing stays diffusers'
        logger.info(f"diffusers_fastpath: {type(pipe).__name__}: video post-processing left as it is ({exc!r})")


def _graphs_serve(model: nn.Module) -> bool:
    """Whether CUDA graphs of `model`'s ``forward`` serve a pipeline: not for a VAE, whose pipelines call its
    ``decode`` and ``encode`` (a graph of its forward would never replay)."""
    return not (callable(getattr(model, "decode", None)) and callable(getattr(model, "encode", None)))


def unpatch(obj: Any) -> Any:
    """Restore every class, attention processor and hook that `patch` changed; a no-op for unpatched objects.

    Args:
        obj: the pipeline or model given to `patch`.

    Returns:
        ``obj``, restored in place.

    Example:
        >>> fp.unpatch(pipe)  # doctest: +SKIP
    """
    for _, model, _ in patched_models(obj):
        undo_patch(model)
    if is_pipeline(obj):
        postprocess.uninstall(obj)
    return obj

