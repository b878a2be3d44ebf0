"""Quality tiers: ``"lossless"`` (the default, bit-identical to unpatched diffusers) and ``"high"`` (opt-in
approximate fusions, close to lossless).

At patch time an adapter marks every place where an approximate fusion can run, a *tier site* (`TierSite`, kept
on the module as ``module._fastpath_tier`` through the model's `PatchState`, so `unpatch` removes it). Mounting
the ``"high"`` tier sets ``mounted`` on each site that can take its fusion; the patched forwards read that flag
per call. All state lives on the modules of one model: two pipelines in one process can run different tiers.

FLUX.1 has one kind of site (76 per FLUX.1-dev step):

- ``linear_gelu`` on each FFN up-projection + tanh-GELU (the dual blocks' ``ff.net.0`` and ``ff_context.net.0``,
  each single block's ``proj_mlp`` + ``act_mlp``): the GELU as the GEMM's cuBLASLt epilogue
  (`diffusers_fastpath.ops.linear_gelu`).

A high-tier fusion stays only where it is faster than the lossless path at its site: the former
``layer_norm_affine`` (the adaLN modulate folded into the LayerNorm's affine) measured slower than the exact fused
LayerNorm + modulate at every FLUX.1 shape on the H200 (70.8 against 33.2 µs at 4608 rows) and was retired.

A site whose module cannot take its fusion (a quantized or LoRA-wrapped linear, a linear without bias, an
activation that is not tanh-GELU, a module with hooks that a direct call would bypass) is not mounted; the mount log
line and `report` say which and why.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ._logging import logger, warn_once
from .ops import Site
from .ops._policy import hooked  # noqa: F401 - the one hook predicate (module, instance forward, global), kept here too
from ._state import STATE_ATTR, PatchState, _check_quality, patched_models

HIGH = "high"
TIER_ATTR = "_fastpath_tier"  # read directly (``norm._fastpath_tier``) by the patched forwards

LINEAR_GELU = "linear_gelu"


class TierSite:
    """One place where a ``"high"``-tier fusion can run.

    Attributes:
        op: the fused op that runs here when mounted.
        mounted: whether the approximate path is on (read per call by the patched forward).
        cannot: why this site's module cannot take the fusion (``None`` if it can); set at each mount/unmount.
        counters: calls on the approximate path (``fast``) and calls sent to the lossless path, by reason.
    """

    def __init__(self, op: str, check: Callable[[nn.Module], str | None]) -> None:
        self.op = op
        self.check = check  # check(module) -> None if the fusion fits the module, else the reason it does not
        self.mounted = False
        self.cannot: str | None = None
        self.counters = Site(op)

    def __repr__(self) -> str:
        return f"TierSite(op={self.op!r}, mounted={self.mounted}, cannot={self.cannot!r}, {self.counters})"


def mark_site(state: PatchState, module: nn.Module, op: str, check: Callable[[nn.Module], str | None]) -> TierSite:
    """Mark `module` as a site of the approximate `op` (unmounted), recorded in `state` so that `unpatch` removes it."""
    site = TierSite(op, check)
    state.set_attr(module, TIER_ATTR, site)
    return site


def tier_sites(model: nn.Module) -> Iterator[tuple[str, nn.Module, TierSite]]:
    """``(name, module, site)`` for every tier site of `model`, in module order."""
    for name, module in model.named_modules():
        site = module.__dict__.get(TIER_ATTR)
        if site is not None:
            yield name, module, site


# --- whether a module can take a fusion (checked at each mount) ----------------------------------------------------


def plain_linear_unfit(linear: nn.Module) -> str | None:
    """Why a fused call cannot read `linear` as a weight and a bias instead of running its forward, hooks aside (the
    caller checks those with whatever else the call skips): not a plain ``nn.Linear`` (LoRA, quantized layers), a
    weight that is not a plain floating-point tensor (quantized), no bias; or ``None``."""
    if type(linear) is not nn.Linear:
        cls = type(linear)  # qualified: PEFT's LoRA layer is also called "Linear"
        return f"{cls.__module__}.{cls.__qualname__} is not a plain nn.Linear (quantized or wrapped, e.g. by LoRA)"
    weight = linear.weight
    if type(weight) not in (nn.Parameter, torch.Tensor) or not weight.is_floating_point() or weight.element_size() < 2:
        return f"weight is not a plain floating-point tensor ({type(weight).__name__}, {weight.dtype}: quantized)"
    if linear.bias is None:
        return "Linear has no bias"
    return None


def linear_gelu_unfit(linear: nn.Module, approximate: str | None, bypassed: tuple[nn.Module, ...] = ()) -> str | None:
    """Why ``gelu(linear(x), approximate)`` cannot run as one GEMM with a tanh-GELU epilogue, or ``None``.
    `bypassed` are further modules whose forward the fused call skips (their hooks would not run)."""
    if approximate != "tanh":
        return "activation is not the tanh GELU"
    reason = plain_linear_unfit(linear)
    if reason is not None:
        return reason
    if any(hooked(m) for m in (linear, *bypassed)):
        return "Linear or activation has hooks"
    return None


# --- mounting -----------------------------------------------------------------------------------------------------


def set_tier(name: str, model: nn.Module, state: PatchState) -> None:
    """Mount (``"high"``) or unmount (``"lossless"``) the sites of the patched `model` to match its effective tier,
    ``state.quality`` (the newest active `quality` request, else the default given to `patch`).

    Every site's fitness is re-checked (a LoRA adapter may have been loaded since). Mounting logs one line saying
    what was mounted and what cannot be, and why (a warning when some site cannot). Callers that change the tier
    hold ``state.lock`` around the change and this call, so that the mounted sites always match the tier.
    """
    tier = state.quality
    _check_quality(tier)
    sites = list(tier_sites(model))
    was_mounted = sum(site.mounted for _, _, site in sites)
    cannot: Counter[str] = Counter()
    per_op: dict[str, list[int]] = {}
    for _, module, site in sites:
        site.cannot = site.check(module)
        site.mounted = tier == HIGH and site.cannot is None
        counts = per_op.setdefault(site.op, [0, 0])
        counts[0] += site.mounted
        counts[1] += 1
        if site.cannot is not None:
            cannot[site.cannot] += 1

    mounted = sum(site.mounted for _, _, site in sites)
    where = f"diffusers_fastpath: {name} ({type(model).__name__}): quality={tier}"
    if tier == HIGH:
        if not sites:
            logger.info(f"{where}: this model has no high-tier fusion sites; it runs the lossless path")
            return
        ops = ", ".join(f"{op} {n}/{m}" for op, (n, m) in per_op.items())
        line = f"{where}: mounted {mounted} of {len(sites)} sites ({ops})"
        if cannot:
            reasons = "; ".join(f"{reason}: {n}" for reason, n in cannot.items())
            logger.warning(f"{line}; {sum(cannot.values())} cannot ({reasons}), they run the lossless path")
        else:
            logger.info(line)
    elif was_mounted:
        logger.info(f"{where}: unmounted {was_mounted} sites, every call takes the lossless path")


NOT_IN_WITH = ("diffusers_fastpath.quality(...) was called outside a `with` statement, so it changed nothing: "
               "write `with fp.quality(pipe, \"high\"): ...` for a block, or `fp.patch(pipe, quality=\"high\")` to "
               "change the tier from now on")


class _QualityRequest:
    """What `quality` returns: a context manager that applies its tier on entry and takes it back on exit.

    Its arguments are checked when it is made (an unknown tier or an unpatched object raises at once). Made and
    dropped without entering (``fp.quality(pipe, "high")`` as a plain statement), it warns once per process that
    nothing changed and says what to write instead, as ``torch.no_grad()`` would not.
    """

    def __init__(self, obj: Any, tier: str) -> None:
        _check_quality(tier)
        if not patched_models(obj):
            raise ValueError(
                f"diffusers_fastpath.quality: this {type(obj).__name__} is not patched; call diffusers_fastpath.patch(...) "
                "on it first."
            )
        self.obj, self.tier = obj, tier
        self.entered: list[tuple[str, nn.Module, PatchState, object]] | None = None

    def __repr__(self) -> str:
        how = "entered" if self.entered is not None else "not entered: it applies only inside a `with` statement"
        return f"<diffusers_fastpath.quality({type(self.obj).__name__}, {self.tier!r}), {how}>"

    def __enter__(self) -> Any:
        if self.entered is not None:
            raise RuntimeError("diffusers_fastpath.quality: this request was entered already; call quality(...) again")
        self.entered = []
        try:
            for name, model, state in patched_models(self.obj):
                with state.lock:
                    self.entered.append((name, model, state, state.push_quality(self.tier)))
                    set_tier(name, model, state)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.obj

    def __exit__(self, *exc: Any) -> None:
        for name, model, state, token in self.entered or ():
            with state.lock:
                state.pop_quality(token)
                if model.__dict__.get(STATE_ATTR) is state:  # unpatched inside the block: nothing left to restore
                    set_tier(name, model, state)

    def __del__(self) -> None:
        if getattr(self, "entered", False) is None:  # made and dropped (an __init__ that raised sets nothing)
            try:
                warn_once(NOT_IN_WITH)
            except Exception:  # noqa: BLE001 - at interpreter exit the logging machinery may be gone
                pass


def quality(obj: Any, tier: str) -> _QualityRequest:
    """Run a patched pipeline or model at quality `tier` inside a ``with`` block; on exit the model's tier is what the
    other requests say.

    ``"high"`` mounts the approximate fusions (output close to lossless: PSNR >= 35 dB and SSIM >= 0.97 on the decoded
    image of a whole generation), ``"lossless"`` unmounts them (output ``torch.equal`` to unpatched diffusers).

    Only a ``with`` block applies it. Called as a plain statement (``fp.quality(pipe, "high")``) it changes nothing
    and warns once that it did not; to change the tier from now on, patch again with it:
    ``fp.patch(pipe, quality="high")`` (a patched pipeline keeps everything else and takes the new default tier).

    The tier is per model, not per thread: while a block is active, every caller of that model (every thread) runs
    at its tier. Each model keeps a stack of the active requests over the default tier given to
    `diffusers_fastpath.patch`: entering pushes this block's request, exiting removes it wherever it is (blocks may
    exit out of order, from other threads, or on an exception), and the model runs at the newest active request,
    or at the default when none is left. Re-patching with another quality changes the default underneath.

    Args:
        obj: a pipeline or model patched with `diffusers_fastpath.patch`.
        tier: ``"lossless"`` or ``"high"``.

    Returns:
        A context manager; ``with`` gives ``obj`` back.

    Raises:
        ValueError: `tier` is not a known tier, or `obj` is not patched (raised by the call itself).

    Example:
        >>> import diffusers_fastpath as fp
        >>> fp.patch(pipe)  # doctest: +SKIP
        >>> with fp.quality(pipe, "high"):  # doctest: +SKIP
        ...     image = pipe(prompt).images[0]
        >>> print(fp.report(pipe))  # doctest: +SKIP
    """
    return _QualityRequest(obj, tier)
