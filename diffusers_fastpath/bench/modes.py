"""The modes: the ways of running the transformer that the benchmark compares (`MODES`, `register_mode`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import diffusers_fastpath as fp


@dataclass
class Context:
    """What a mode may need to know about the run."""

    device: torch.device
    compile_kwargs: dict[str, Any] = field(default_factory=dict)
    # the pipeline around the model, at the generation level: the patching modes patch it whole, as a user does
    # (``fp.patch(pipe)``: its VAE too), and the step level (no pipeline here) the transformer alone
    pipe: Any = None


Undo = Callable[[], None]


@dataclass(frozen=True)
class Mode:
    """One way of running the transformer.

    Args:
        name: the name used by ``--modes`` and in the report.
        description: one line for ``--help`` and the JSON.
        apply: ``apply(model, ctx) -> undo``: change `model` in place, return the function that restores it.
        exact: the mode promises output bit-identical to eager (a mismatch makes the exit status 1).
        compiled: the mode compiles (run once after ``torch._dynamo.reset()``, first call timed as compile time).
        graphs: the mode replays the step as CUDA graphs (the parts level records its base mode instead).
        unavailable: ``unavailable(ctx) -> str | None``: why the mode cannot run here, or ``None``.
    """

    name: str
    description: str
    apply: Callable[[nn.Module, Context], Undo]
    exact: bool = False
    compiled: bool = False
    graphs: bool = False
    unavailable: Callable[[Context], str | None] = lambda ctx: None


MODES: dict[str, Mode] = {}


def register_mode(mode: Mode) -> Mode:
    """Add (or replace) a mode; the report lists modes in registration order."""
    MODES[mode.name] = mode
    return mode


def _patched(**patch_kwargs: Any) -> Callable[[nn.Module, Context], Undo]:
    """``fp.patch(pipe, **patch_kwargs)`` where the context holds the pipeline (every model `patch` takes there),
    else ``fp.patch(model, ...)``; undone by ``fp.unpatch``."""

    def apply(model: nn.Module, ctx: Context) -> Undo:
        target = ctx.pipe if ctx.pipe is not None else model
        fp.patch(target, **patch_kwargs)
        return lambda: fp.unpatch(target)

    return apply


def _compiled(inner: Callable[[nn.Module, Context], Undo] | None = None) -> Callable[[nn.Module, Context], Undo]:
    def apply(model: nn.Module, ctx: Context) -> Undo:
        undo_inner = inner(model, ctx) if inner is not None else (lambda: None)
        # nn.Module.compile compiles __call__ in place: the pipeline keeps calling the same module object.
        model.compile(**ctx.compile_kwargs)

        def undo() -> None:
            model._compiled_call_impl = None  # what nn.Module.compile set; there is no public "uncompile"
            undo_inner()

        return undo

    return apply


def _quality_missing(quality: str) -> Callable[[Context], str | None]:
    def unavailable(ctx: Context) -> str | None:
        from .._state import QUALITIES

        if quality not in QUALITIES:
            return f"quality tier {quality!r} is not in this build (diffusers_fastpath.patching.QUALITIES: {QUALITIES})"
        return None

    return unavailable


def _compile_missing(ctx: Context) -> str | None:
    if not hasattr(torch, "compile") or not hasattr(nn.Module, "compile"):
        return f"torch {torch.__version__} has no torch.compile / nn.Module.compile (torch >= 2.2 needed)"
    if ctx.device.type == "cuda" and ctx.compile_kwargs.get("backend", "inductor") == "inductor":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - every torch with nn.Module.compile has it
            return None
        if not has_triton():
            return "the inductor backend needs triton on CUDA (pip install triton)"
    return None


register_mode(Mode("eager", "unpatched diffusers, the reference", lambda model, ctx: (lambda: None), exact=True))
register_mode(Mode("lossless", "fp.patch(model): bit-identical to eager", _patched(), exact=True))
register_mode(Mode("high", 'fp.patch(model, quality="high"): approximate fusions', _patched(quality="high"),
                   unavailable=_quality_missing("high")))
register_mode(Mode("lossless+graphs", "fp.patch(model, cuda_graphs=True): lossless, replayed as CUDA graphs",
                   _patched(cuda_graphs=True), exact=True, graphs=True))
register_mode(Mode("compile", "torch.compile of the unpatched transformer", _compiled(), compiled=True,
                   unavailable=_compile_missing))
register_mode(Mode("lossless+compile", "fp.patch(model), then torch.compile", _compiled(_patched()), compiled=True,
                   unavailable=_compile_missing))


@contextlib.contextmanager
def applied(mode: Mode, model: nn.Module, ctx: Context):
    undo = mode.apply(model, ctx)
    try:
        yield
    finally:
        undo()


def fastpath_summary(obj: Any) -> dict[str, Any] | None:
    """Fused-site counters of a patched model or pipeline (None when nothing in it is patched): shows the fast path
    really ran, and which models were patched (``models``: name, class and counters of each, e.g. the transformer
    and the VAE of a pipeline)."""
    rep = fp.report(obj)
    if not rep.models:
        return None
    # kernel_calls: fast calls that ran a fused kernel (a CPU run has none; `render` says so beside its ratios)
    summary: dict[str, Any] = {"sites": len(rep.sites), "fast": rep.fast, "fallback": rep.fallback,
                               "kernel_calls": rep.kernel_calls}
    summary["models"] = [
        {"name": m.name, "class": m.cls, "sites": len(rows), "fast": sum(r.fast for r in rows),
         "fallback": sum(r.fallback for r in rows)}
        for m in rep.models for rows in ([r for r in rep.sites if r.model == m.name],)]
    graphs = next((m.graphs for m in rep.models if m.graphs), None)
    if graphs:  # cuda_graphs=True: whether the step really replayed, and why calls ran eager when they did not
        summary["graphs"] = {k: graphs[k] for k in ("status", "captured", "replays", "eager")}
    return summary
