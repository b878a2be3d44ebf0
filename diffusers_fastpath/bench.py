"""The benchmark command: eager, lossless, high and torch.compile side by side, exactness proven in the same run.

    python -m diffusers_fastpath.bench                                    # flux-tiny: runs anywhere, CPU included
    python -m diffusers_fastpath.bench --model flux-dev --kernels --profile --json run.json
    python -m diffusers_fastpath.bench --model ernie-image --levels step --modes eager,lossless
    python -m diffusers_fastpath.bench --model black-forest-labs/FLUX.1-dev     # real weights (a Hub id or a folder)
    python -m diffusers_fastpath.bench --from-json run.json --plot run.png      # re-render a saved run, run nothing

Models: ``flux-tiny`` (default), ``flux-dev`` (the published FLUX.1-dev transformer and VAE configs with random
weights: speed and exactness do not depend on the weights, and nothing is downloaded), ``ernie-image`` and
``ernie-image-tiny`` (step level and kernels), or any FLUX pipeline path/id for ``FluxPipeline.from_pretrained``.

Levels (``--levels``, default ``step,generation``; ``--kernels`` adds ``kernels``, ``--profile`` adds ``profile``):

- **step**: one transformer forward; median of ``--repeats`` timed calls (CUDA events; ``perf_counter`` on CPU),
  warm-up excluded, host enqueue time (the Python call returning, before the GPU finishes) beside it. The
  non-compiled modes run round-robin, one warm-up and one timed call per mode and round, so clock drift lands in
  the spread, not in the ratio.
- **generation**: a whole ``FluxPipeline`` call from precomputed prompt embeddings (no text encoder), VAE decode
  included; md5 of the final latents (captured by a step-end callback of the same call) and of the decoded image.
- **profile**: one step per mode under ``torch.profiler``: kernel count and time per category (`CATEGORIES`).
- **kernels**: every fused op at the model's real shapes, eager chain against fused kernel, with the GB/s of a
  device-to-device copy measured in the same run, and the host cost of one call.

Exactness is computed in the run: every mode's output is compared with eager's by ``torch.equal`` and by md5 of
its raw bytes, with max abs diff, PSNR and (images) SSIM. Compiled modes run after the others, each after
``torch._dynamo.reset()`` on the same weights, with the first call reported as compile time. The exit status is 1
when a mode that promises bit-identity (eager, lossless) or a fused kernel is not bit-identical, 2 on a usage error.

Modes are the `MODES` registry: adding one is one `register_mode` call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

import diffusers_fastpath as fp

from ._logging import logger
from .metrics import psnr, ssim

SCHEMA = 1
LEVELS = ("step", "generation", "profile", "kernels")
FLUX_MODELS = ("flux-tiny", "flux-dev")
ERNIE_MODELS = ("ernie-image-tiny", "ernie-image")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------------- modes


@dataclass
class Context:
    """What a mode may need to know about the run."""

    device: torch.device
    compile_kwargs: dict[str, Any] = field(default_factory=dict)


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
        unavailable: ``unavailable(ctx) -> str | None``: why the mode cannot run here, or ``None``.
    """

    name: str
    description: str
    apply: Callable[[nn.Module, Context], Undo]
    exact: bool = False
    compiled: bool = False
    unavailable: Callable[[Context], str | None] = lambda ctx: None


MODES: dict[str, Mode] = {}


def register_mode(mode: Mode) -> Mode:
    """Add (or replace) a mode; the report lists modes in registration order."""
    MODES[mode.name] = mode
    return mode


def _patched(**patch_kwargs: Any) -> Callable[[nn.Module, Context], Undo]:
    """``fp.patch(model, **patch_kwargs)``, undone by ``fp.unpatch``."""

    def apply(model: nn.Module, ctx: Context) -> Undo:
        fp.patch(model, **patch_kwargs)
        return lambda: fp.unpatch(model)

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
        from ._state import QUALITIES

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
                   _patched(cuda_graphs=True), exact=True))
register_mode(Mode("compile", "torch.compile of the unpatched transformer", _compiled(), compiled=True,
                   unavailable=_compile_missing))
register_mode(Mode("lossless+compile", "fp.patch(model), then torch.compile", _compiled(_patched()), compiled=True,
                   unavailable=_compile_missing))


@contextlib.contextmanager
def _applied(mode: Mode, model: nn.Module, ctx: Context):
    undo = mode.apply(model, ctx)
    try:
        yield
    finally:
        undo()


def _fastpath_summary(model: nn.Module) -> dict[str, int] | None:
    """Fused-site counters of a patched model (None when it is not patched): shows the fast path really ran."""
    from ._state import STATE_ATTR

    if STATE_ATTR not in model.__dict__:
        return None
    rep = fp.report(model)
    return {"sites": len(rep.sites), "fast": rep.fast, "fallback": rep.fallback}


# ---------------------------------------------------------------------------------------------------- conditions


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def commit() -> str:
    """``$GIT_COMMIT`` when set (copies of the tree made for a run elsewhere set it), else ``git rev-parse --short
    HEAD`` (``-dirty`` with uncommitted changes) when the package sits in a git checkout, else ``"unknown"``."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = _repo_root()
    if (root / ".git").exists():
        try:
            head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
            if head:
                dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, capture_output=True, timeout=10)
                return head + ("-dirty" if dirty.returncode == 1 else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    if torch.cuda.is_available():
        try:
            v = torch._C._cuda_getDriverVersion()  # e.g. 12040: the CUDA version the driver supports
            return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
        except (AttributeError, RuntimeError):
            pass
    return None


def conditions(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Everything a number in the report depends on."""
    import diffusers

    cuda = device.type == "cuda"
    return dict(
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if cuda else None,
        cpu=platform.processor() or platform.machine(),
        driver=_driver_version() if cuda else None,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        diffusers=diffusers.__version__,
        diffusers_fastpath=fp.__version__,
        python=platform.python_version(),
        model=args.model,
        dtype=str(DTYPES[args.dtype]).removeprefix("torch."),
        height=args.height,
        width=args.width,
        steps=args.steps,
        batch=args.batch,
        text_tokens=args.text_tokens,
        commit=commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


# ---------------------------------------------------------------------------------------------------- measuring


class Clock:
    """Times one call: device time (CUDA events; wall time on CPU) and host time until the call returns."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """``(result, ms, host_ms)``."""
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        if not self.cuda:
            return out, host_ms, host_ms
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end), host_ms

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None


@dataclass
class Samples:
    """What one mode gave at one level."""

    ms: list[float] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)
    peak_gib: float | None = None
    out: Any = None  # the first timed call's output (the exactness check compares it with eager's)
    repeatable: bool = True  # every timed call gave the same output as the first
    compile_s: float | None = None
    warmup_s: float | None = None
    fastpath: dict[str, int] | None = None

    def add(self, out: Any, ms: float, host_ms: float, peak: float | None) -> None:
        if self.out is None:
            self.out = out
        else:
            self.repeatable = self.repeatable and _equal(out, self.out)
        self.ms.append(ms)
        self.host_ms.append(host_ms)
        if peak is not None:
            self.peak_gib = max(self.peak_gib or 0.0, peak)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    import numpy as np

    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def md5(x: Any) -> str:
    """md5 of the raw bytes of a tensor (any dtype, bf16 included) or a numpy array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.md5(x.tobytes()).hexdigest()


def _max_abs_diff(a: Any, b: Any) -> float:
    if isinstance(a, (tuple, list)):  # ops with several outputs (the gated RMSNorm: residual and normed)
        return max((_max_abs_diff(x, y) for x, y in zip(a, b)), default=0.0)
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    return (a.double() - b.to(a.device).double()).abs().max().item() if a.numel() else 0.0  # on a's device


def _finite(x: float | None) -> float | str | None:
    """JSON has no infinity: identical outputs have PSNR "inf"."""
    return "inf" if x is not None and math.isinf(x) else x


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, leave=False, dynamic_ncols=True)


def _round_robin(modes: list[Mode], rounds: int, model: nn.Module, ctx: Context, body: Callable[[Mode, int], None],
                 apply: bool = True) -> None:
    """``body(mode, round)`` for every round and mode in turn, each mode applied around its own call (unless the
    caller already applied the single mode it passes)."""
    for r in range(rounds):
        for mode in modes:
            if apply:
                with _applied(mode, model, ctx):
                    body(mode, r)
            else:
                body(mode, r)


# ---------------------------------------------------------------------------------------------------- the model


@dataclass
class Subject:
    """The model under test: its transformer, one step's inputs and, for FLUX, a pipeline around it."""

    name: str
    family: str  # "flux" or "ernie"
    transformer: nn.Module
    step_inputs: dict[str, Any]
    pipe: Any = None
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    no_generation: str | None = None  # why the generation level cannot run for this model

    def step(self) -> torch.Tensor:
        return self.transformer(**self.step_inputs, return_dict=False)[0]


def build_subject(args: argparse.Namespace, device: torch.device, need_vae: bool) -> Subject:
    """The model the arguments name, with random weights unless it is a real pipeline."""
    from . import testing

    dtype = DTYPES[args.dtype]
    grid = (args.height // 16, args.width // 16)
    if args.model in ERNIE_MODELS:
        model = testing.build_ernie_image_transformer(args.model, dtype, device, seed=args.seed)
        inputs = testing.ernie_image_inputs(model, batch=args.batch, grid=grid, text_lens=(args.text_tokens,),
                                            seed=args.seed + 1)
        return Subject(args.model, "ernie", model, inputs,
                       no_generation="not for ERNIE-Image here (no VAE config is published with this package); "
                                     "use the step level")
    if args.model in FLUX_MODELS:
        model = testing.build_flux_transformer(args.model, dtype, device, seed=args.seed)
        vae = None
        if need_vae:
            vae = testing.build_flux_vae(args.model, dtype, device, seed=args.seed + 1,
                                         latent_channels=model.config.in_channels // 4)
        pipe = testing.flux_pipeline(model, vae)
        call_kwargs = testing.prompt_embeddings(pipe, batch=args.batch, txt_tokens=args.text_tokens, seed=args.seed + 2)
    else:  # a real FLUX pipeline (Hub id or folder); prompt embeddings from its own text encoders
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.model, torch_dtype=dtype).to(device)
        model = pipe.transformer
        with torch.no_grad():
            embeds, pooled, _ = pipe.encode_prompt(prompt=args.prompt, prompt_2=None, device=device,
                                                   num_images_per_prompt=args.batch,
                                                   max_sequence_length=args.text_tokens)
        call_kwargs = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
    pipe.set_progress_bar_config(disable=True)
    subject = Subject(args.model, "flux", model, {}, pipe=pipe, call_kwargs=call_kwargs)
    subject.step_inputs = _pipeline_step_inputs(subject, args, device)
    return subject


def _pipeline_step_inputs(subject: Subject, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The transformer's inputs exactly as the pipeline passes them at its first step (dtypes and strides
    included, so that a compiled step and a compiled generation share one graph)."""
    captured: dict[str, Any] = {}

    def grab(module, posargs, kwargs):
        if not captured:
            captured.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    handle = subject.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        _generate(subject, args, device, steps=1, output_type="latent")
    finally:
        handle.remove()
    captured.pop("return_dict", None)
    return captured


# ---------------------------------------------------------------------------------------------------- step level


def _step_once(subject: Subject, clock: Clock, samples: Samples) -> None:
    clock.reset_peak()
    clock.time(subject.step)  # warm-up: the first call after patching builds caches (rotary table, ...)
    out, ms, host_ms = clock.time(subject.step)
    samples.add(out, ms, host_ms, clock.peak_gib())
    if samples.fastpath is None:
        samples.fastpath = _fastpath_summary(subject.transformer)


def _step_row(mode: Mode, s: Samples, ref: Samples | None) -> dict[str, Any]:
    ms = statistics.median(s.ms)
    out, eager_out = s.out.float(), ref.out.float() if ref is not None else None
    if eager_out is not None:
        data_range = (eager_out.max() - eager_out.min()).item() or 1.0
    return dict(
        mode=mode.name,
        available=True,
        reason=None,
        ms=ms,
        host_ms=statistics.median(s.host_ms),
        ms_all=s.ms,
        host_ms_all=s.host_ms,
        ratio=ms / statistics.median(ref.ms) if ref is not None else None,
        peak_mem_gib=s.peak_gib,
        compile_s=s.compile_s,
        md5=md5(s.out),
        bit_identical=_equal(s.out, ref.out) if ref is not None else None,
        max_abs_diff=_max_abs_diff(out, eager_out) if ref is not None else None,
        psnr_db=_finite(psnr(out, eager_out, data_range=data_range)) if ref is not None else None,
        repeatable=s.repeatable,
        interleaved=not mode.compiled,
        fastpath=s.fastpath,
    )


# ---------------------------------------------------------------------------------------------------- generation


def _generate(subject: Subject, args: argparse.Namespace, device: torch.device, steps: int,
              output_type: str = "np") -> dict[str, Any]:
    captured = {}

    def on_step_end(pipe, i, t, kwargs):
        captured["latents"] = kwargs["latents"]  # the final latents, before unpacking and decoding
        return {}

    generator = torch.Generator(device).manual_seed(args.seed + 3)
    images = subject.pipe(**subject.call_kwargs, height=args.height, width=args.width, num_inference_steps=steps,
                          generator=generator, output_type=output_type, callback_on_step_end=on_step_end).images
    return dict(latents=captured["latents"], image=images)


def _generation_once(subject: Subject, args, device, clock: Clock, samples: Samples) -> None:
    clock.reset_peak()
    t0 = time.perf_counter()
    _generate(subject, args, device, steps=1)  # warm-up
    clock.sync()
    samples.warmup_s = samples.warmup_s or time.perf_counter() - t0
    out, ms, host_ms = clock.time(lambda: _generate(subject, args, device, steps=args.steps))
    samples.add((out["latents"], out["image"]), ms, host_ms, clock.peak_gib())
    if samples.fastpath is None:
        samples.fastpath = _fastpath_summary(subject.transformer)


def _generation_row(mode: Mode, s: Samples, ref: Samples | None) -> dict[str, Any]:
    ms = statistics.median(s.ms)
    latents, image = s.out
    row = dict(
        mode=mode.name,
        available=True,
        reason=None,
        s=ms / 1e3,
        s_all=[m / 1e3 for m in s.ms],
        host_s=statistics.median(s.host_ms) / 1e3,
        ratio=ms / statistics.median(ref.ms) if ref is not None else None,
        peak_mem_gib=s.peak_gib,
        compile_s=s.compile_s,
        warmup_s=s.warmup_s,
        latents_md5=md5(latents),
        image_md5=md5(image),
        image_shape=list(image.shape),
        bit_identical=None,
        latents_identical=None,
        image_identical=None,
        max_abs_diff_latents=None,
        psnr_db=None,
        ssim=None,
        repeatable=s.repeatable,
        interleaved=not mode.compiled,
        fastpath=s.fastpath,
    )
    if ref is not None:
        ref_latents, ref_image = ref.out
        row["latents_identical"] = _equal(latents, ref_latents)
        row["image_identical"] = _equal(image, ref_image)
        row["bit_identical"] = row["latents_identical"] and row["image_identical"]
        row["max_abs_diff_latents"] = _max_abs_diff(latents.float(), ref_latents.float())
        row["psnr_db"] = _finite(psnr(image, ref_image))
        row["ssim"] = ssim(image, ref_image)
    return row


# ---------------------------------------------------------------------------------------------------- profile

# First match wins, on the kernel's name (CUDA) or the leaf op's name (CPU); our kernels live in the
# diffusers_fastpath namespace. Inductor names its kernels triton_{poi,per,red,tem}_fused_<ops>.
CATEGORIES: list[tuple[str, re.Pattern]] = [
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in [
        ("fused", r"diffusers_fastpath|fastpath"),
        ("attention", r"flash|fmha|attention|attn|sdpa|scaled_dot_product|softmax"),
        ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|triton_tem|aten::(mm|addmm|bmm|baddbmm|matmul|linear)\b"),
        ("norm", r"norm"),
        ("copy/cat", r"copy|\bcat\b|_cat_|CatArray|memcpy|memset|index|gather|scatter|"
                     r"aten::(cat|to|_to_copy|contiguous|clone|stack)\b"),
        ("elementwise", r"elementwise|vectorized|unrolled|reduce|triton_(poi|per|red)|aten::\w+"),
    ]
]
CATEGORY_NAMES = [name for name, _ in CATEGORIES] + ["other"]
# aten ops that only make views or allocate (no kernel of their own), left out of the CPU profile
_METADATA_OPS = re.compile(
    r"aten::(view|_unsafe_view|reshape|as_strided|expand|t|transpose|permute|unsqueeze|squeeze|slice|select|split|"
    r"split_with_sizes|chunk|unbind|narrow|detach|alias|lift_fresh|resolve_conj|resolve_neg|empty|empty_like|"
    r"empty_strided|flatten|unflatten|view_as_real|view_as_complex|_reshape_alias|result_type|is_nonzero|item|"
    r"_local_scalar_dense)$"
)


def categorize(kernel_name: str) -> str:
    """The category (`CATEGORY_NAMES`) of a kernel or op name."""
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "other"


PROFILE_TOP = 15  # the kernels (by name) that took the most time, per mode, kept in the JSON and the report


def _profile_step(subject: Subject, clock: Clock) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    clock.sync()
    with profile(activities=activities) as prof:
        subject.step()
        clock.sync()
    idle = None
    if clock.cuda:  # the kernels (and memcpy/memset) the GPU ran
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        idle = _idle_gaps(events)
    else:  # on CPU, the outermost aten ops (what the model's code calls), without views and allocations
        def aten(e) -> bool:
            return e.device_type == DeviceType.CPU and e.name.startswith("aten::")

        def outermost(e) -> bool:
            parent = e.cpu_parent
            while parent is not None and not aten(parent):
                parent = parent.cpu_parent
            return parent is None

        events = [e for e in prof.events() if aten(e) and not _METADATA_OPS.match(e.name) and outermost(e)]
    per = {name: {"count": 0, "ms": 0.0} for name in CATEGORY_NAMES}
    by_name: dict[str, list] = {}
    for e in events:
        c = per[categorize(e.name)]
        ms = e.time_range.elapsed_us() / 1e3
        c["count"] += 1
        c["ms"] += ms
        entry = by_name.setdefault(e.name, [categorize(e.name), 0, 0.0])
        entry[1] += 1
        entry[2] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:PROFILE_TOP]
    return dict(kernels=len(events), ms=sum(c["ms"] for c in per.values()), categories=per,
                top=[dict(name=name[:160], category=cat, count=n, ms=ms) for name, (cat, n, ms) in top],
                unit="CUDA kernels" if clock.cuda else "outermost aten ops on CPU", idle=idle)


IDLE_GAP_US = 5.0  # gaps between kernels at least this long are listed by the kernel that waited


def _idle_gaps(kernels: list) -> dict[str, Any]:
    """Where the GPU sat idle in the profiled step: the time between its first kernel's start and last kernel's end
    that no kernel covers, and the kernels that waited longest after a gap. Taken under the profiler, whose host
    overhead makes launch-bound gaps longer than in the timed steps: compare modes within one run, not across runs."""
    if not kernels:
        return dict(span_ms=0.0, ms=0.0, gaps=0, by_kernel=[])
    kernels = sorted(kernels, key=lambda e: e.time_range.start)
    busy_until = kernels[0].time_range.start
    idle_us = 0.0
    gaps = 0
    by_kernel: dict[str, list] = {}
    for e in kernels:
        start = e.time_range.start
        if start > busy_until:
            gap = start - busy_until
            idle_us += gap
            if gap >= IDLE_GAP_US:
                gaps += 1
                entry = by_kernel.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += gap
        busy_until = max(busy_until, e.time_range.end)
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:8]
    span_us = busy_until - kernels[0].time_range.start
    return dict(span_ms=span_us / 1e3, ms=idle_us / 1e3, gaps=gaps,
                by_kernel=[dict(kernel=name[:120], count=n, ms=us / 1e3) for name, (n, us) in top])


# ---------------------------------------------------------------------------------------------------- kernels


@dataclass
class Shapes:
    """The shapes a model really gives its fused ops at the benchmark's resolution, batch and text length."""

    family: str
    model: nn.Module
    hidden: int
    image_tokens: int
    text_tokens: int
    batch: int
    dtype: torch.dtype
    device: torch.device

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, device=self.device, dtype=self.dtype)


@dataclass
class KernelCase:
    """One fused op at one shape: ``eager(*s)`` and ``fused(*s)`` for each input set ``s`` in `sets` (rotated past
    the L2 cache; ``s[0]`` is the activation, which the reference copy moves), `nbytes` read plus written by the
    fused kernel per call."""

    op: str
    shape: tuple[int, ...]
    sets: list[tuple[Any, ...]]
    eager: Callable[..., Any]
    fused: Callable[..., Any]
    nbytes: int
    exact: bool = True  # False for the "high" tier's approximate fusions: the row gives the max abs difference


KERNEL_CASES: dict[str, Callable[[Shapes], list[KernelCase]]] = {}


def kernel_cases(fn: Callable[[Shapes], list[KernelCase]]) -> Callable[[Shapes], list[KernelCase]]:
    """Register ``fn(shapes) -> [KernelCase, ...]`` (an empty list where the op is not used by the model)."""
    KERNEL_CASES[fn.__name__] = fn
    return fn


def _input_sets(make: Callable[[], tuple[Any, ...]], budget_bytes: int = 256 * 2**20, most: int = 16) -> list:
    """Fresh input sets until they span `budget_bytes` (well past an H200's 60 MB L2), at least 2, at most `most`."""
    sets, total = [], 0
    while len(sets) < 2 or (total < budget_bytes and len(sets) < most):
        s = make()
        sets.append(s)
        total += sum(t.numel() * t.element_size() for t in s if isinstance(t, torch.Tensor))
    return sets


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@kernel_cases
def modulate_scale_shift_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX's adaLN modulate: image, text and single-block (image + text) rows."""
    if sh.family != "flux":
        return []
    from .ops import modulate_scale_shift_ref

    op = torch.ops.diffusers_fastpath._modulate_scale_shift_cuda.default
    b, d = sh.batch, sh.hidden
    cases = []
    for tokens in (sh.image_tokens, sh.text_tokens, sh.image_tokens + sh.text_tokens):
        def make():
            shift, scale = sh.randn(b, 6 * d).chunk(6, dim=1)[:2]  # the AdaLayerNormZero views
            return sh.randn(b, tokens, d), scale, shift

        sets = _input_sets(make)
        x, scale, shift = sets[0]
        cases.append(KernelCase("modulate_scale_shift", (b, tokens, d), sets, modulate_scale_shift_ref, op,
                                2 * _nbytes(x) + 2 * _nbytes(scale)))
    return cases


def _flux_adaln_inputs(sh: Shapes, tokens: int):
    """An adaLN site's inputs: activations and the (shift, scale) chunk views of the adaLN linear output."""
    b, d = sh.batch, sh.hidden

    def make():
        shift, scale = sh.randn(b, 6 * d).chunk(6, dim=1)[:2]
        return sh.randn(b, tokens, d), scale, shift

    return _input_sets(make)


def _flux_token_counts(sh: Shapes) -> tuple[int, ...]:
    return (sh.image_tokens, sh.text_tokens, sh.image_tokens + sh.text_tokens)


@kernel_cases
def layernorm_scale_shift_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX's adaLN LayerNorm + modulate (lossless, one kernel) and its "high"-tier fold into the LayerNorm affine."""
    if sh.family != "flux":
        return []
    from .ops import layernorm_scale_shift_ref
    from .ops.layer_norm_affine import folded_layer_norm

    ops = torch.ops.diffusers_fastpath
    norm = nn.LayerNorm(sh.hidden, elementwise_affine=False, eps=1e-6)
    cases = []
    for tokens in _flux_token_counts(sh):
        sets = _flux_adaln_inputs(sh, tokens)
        x, scale, shift = sets[0]
        shape, nbytes = (sh.batch, tokens, sh.hidden), 2 * _nbytes(x) + 2 * _nbytes(scale)
        eager = lambda x, s, h: layernorm_scale_shift_ref(norm, x, s, h)  # noqa: E731
        cases.append(KernelCase("layernorm_scale_shift", shape, sets, eager,
                                lambda x, s, h: ops._layernorm_scale_shift_cuda(x, s, h, norm.eps), nbytes))
        if sh.batch == 1:  # the fold takes one row of scale/shift
            cases.append(KernelCase("layer_norm_affine (high)", shape, sets, eager,
                                    lambda x, s, h: folded_layer_norm(x, s, h, norm.eps), nbytes, exact=False))
    return cases


@kernel_cases
def gated_residual_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX's ``residual + gate.unsqueeze(1) * update`` at the image, text and single-block sites."""
    if sh.family != "flux":
        return []
    from .ops import gated_residual_ref

    op = torch.ops.diffusers_fastpath._gated_residual_cuda.default
    b, d = sh.batch, sh.hidden
    cases = []
    for tokens in _flux_token_counts(sh):
        def make():
            gate = sh.randn(b, 6 * d).chunk(6, dim=1)[2].unsqueeze(1)  # gate_msa, as the block passes it
            return sh.randn(b, tokens, d), gate, sh.randn(b, tokens, d)

        sets = _input_sets(make)
        x, gate, _ = sets[0]
        cases.append(KernelCase("gated_residual", (b, tokens, d), sets, gated_residual_ref, op,
                                3 * _nbytes(x) + _nbytes(gate)))
    return cases


@kernel_cases
def gelu_cat_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX's single block: ``cat([attn_output, gelu_tanh(proj_mlp(x))], dim=2)`` in one pass."""
    if sh.family != "flux":
        return []
    from .ops import gelu_cat_ref

    op = torch.ops.diffusers_fastpath._gelu_cat_cuda.default
    b, d, tokens = sh.batch, sh.hidden, sh.image_tokens + sh.text_tokens
    mlp_dim = int(getattr(sh.model.single_transformer_blocks[0].proj_mlp, "out_features", 4 * d))
    sets = _input_sets(lambda: (sh.randn(b, tokens, d), sh.randn(b, tokens, mlp_dim) * 4))
    attn, mlp = sets[0]
    nbytes = 2 * (_nbytes(attn) + _nbytes(mlp))
    return [KernelCase("gelu_cat", (b, tokens, d + mlp_dim), sets, gelu_cat_ref, op, nbytes)]


@kernel_cases
def rotary_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX's attention: the rotary embedding alone, and fused with the QK RMSNorm and the text/image
    concatenation (dual blocks: text + image sources; single blocks: one joint source)."""
    if sh.family != "flux":
        return []
    from .ops import qk_norm_rope_ref, rotary_emb_ref

    ops = torch.ops.diffusers_fastpath
    cfg = sh.model.config
    heads, dim, b = cfg.num_attention_heads, cfg.attention_head_dim, sh.batch
    norms = [torch.nn.RMSNorm(dim, eps=1e-6).to(sh.device, sh.dtype).requires_grad_(False) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.normal_(1.0, 0.1)

    def cases_for(txt: int, img: int) -> list[KernelCase]:
        seq = txt + img
        cos, sin = (torch.rand(seq, dim, device=sh.device) * 2 - 1 for _ in range(2))
        sets = _input_sets(lambda: (sh.randn(b, img, heads, dim), sh.randn(b, txt, heads, dim) if txt else None))
        nbytes = 2 * _nbytes(sets[0][0]) * seq // img + 2 * _nbytes(cos)
        n_txt, n_img = (norms[0] if txt else None), norms[1]
        w_txt, eps_txt = (n_txt.weight, n_txt.eps) if txt else (None, 0.0)
        out = []
        if not txt:
            out.append(KernelCase("rotary_emb", (b, seq, heads, dim), sets, lambda i, t: rotary_emb_ref(i, cos, sin),
                                  lambda i, t: ops._rotary_emb_cuda(i, cos, sin), nbytes))
        out.append(KernelCase(
            "qk_norm_rope" + (" (text+image)" if txt else ""), (b, seq, heads, dim), sets,
            lambda i, t: qk_norm_rope_ref(n_txt, t, n_img, i, cos, sin),
            lambda i, t: ops._qk_norm_rope_cuda(t, w_txt, eps_txt, i, n_img.weight, n_img.eps, cos, sin), nbytes))
        return out

    return cases_for(sh.text_tokens, sh.image_tokens) + cases_for(0, sh.image_tokens + sh.text_tokens)


@kernel_cases
def linear_gelu_cases(sh: Shapes) -> list[KernelCase]:
    """The "high" tier's FFN up-projection + tanh-GELU in one cuBLASLt call (GEMM-bound: bytes are the operands)."""
    if sh.family != "flux":
        return []
    from .ops.linear_gelu import linear_gelu_epilogue, linear_gelu_ref

    d, b = sh.hidden, sh.batch
    tokens = sh.image_tokens + sh.text_tokens  # the single block's proj_mlp
    weight, bias = sh.randn(4 * d, d) / d**0.5, sh.randn(4 * d) * 0.05
    sets = _input_sets(lambda: (sh.randn(b, tokens, d),), budget_bytes=64 * 2**20, most=4)
    nbytes = _nbytes(sets[0][0]) + _nbytes(weight) + _nbytes(bias) + 4 * _nbytes(sets[0][0])
    return [KernelCase("linear_gelu (high)", (b, tokens, d), sets,
                       lambda x: linear_gelu_ref(x, weight, bias), lambda x: linear_gelu_epilogue(x, weight, bias),
                       nbytes, exact=False)]


@kernel_cases
def rmsnorm_scale_shift_cases(sh: Shapes) -> list[KernelCase]:
    """ERNIE-Image's adaLN: RMSNorm + fp32 modulate, and its gated-residual variant, at [seq, batch, dim]."""
    if sh.family != "ernie":
        return []
    from diffusers.models.normalization import RMSNorm

    from .ops import gated_rmsnorm_scale_shift_ref, rmsnorm_scale_shift_ref

    ops = torch.ops.diffusers_fastpath
    seq, b, d = sh.image_tokens + sh.text_tokens, sh.batch, sh.hidden
    norm = RMSNorm(d, eps=1e-6).to(sh.device, sh.dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)

    def make():
        rows = [sh.randn(1, b, d).expand(seq, -1, -1).contiguous() for _ in range(3)]  # scale, shift, gate
        update = sh.randn(b, seq, d).permute(1, 0, 2)  # the attention output, back to sequence-first
        return (sh.randn(seq, b, d), *rows, update)

    sets = _input_sets(make)
    e = _nbytes(sets[0][0])
    return [
        KernelCase("rmsnorm_scale_shift", (seq, b, d), sets,
                   lambda x, s, h, g, u: rmsnorm_scale_shift_ref(norm, x, s, h),
                   lambda x, s, h, g, u: ops._rmsnorm_scale_shift_cuda(x, norm.weight, s, h, norm.eps), 4 * e),
        KernelCase("gated_rmsnorm_scale_shift", (seq, b, d), sets,
                   lambda x, s, h, g, u: gated_rmsnorm_scale_shift_ref(norm, x, g, u, s, h),
                   lambda x, s, h, g, u: ops._gated_rmsnorm_scale_shift_cuda(x, g, u, norm.weight, s, h, norm.eps),
                   7 * e),
    ]


def gpu_time_us(fn: Callable[..., Any], sets: list, iters: int = 40, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of `iters` back-to-back calls (CUDA events), rotating input sets."""
    for s in sets[:2]:
        fn(*s)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def _kernel_row(case: KernelCase) -> dict[str, Any]:
    x = case.sets[0][0]
    copies = [(s[0], torch.empty_like(s[0])) for s in case.sets]
    eager_us = gpu_time_us(case.eager, case.sets)
    fused_us = gpu_time_us(case.fused, case.sets)
    copy_us = gpu_time_us(lambda src, dst: dst.copy_(src), copies)
    fused_gbps = case.nbytes / fused_us / 1e3
    copy_gbps = 2 * _nbytes(x) / copy_us / 1e3
    return dict(
        op=case.op,
        shape=list(case.shape),
        dtype=str(x.dtype).removeprefix("torch."),
        eager_us=eager_us,
        fused_us=fused_us,
        speedup=eager_us / fused_us,
        bytes=case.nbytes,
        fused_GBps=fused_gbps,
        copy_us=copy_us,
        copy_GBps=copy_gbps,
        pct_of_copy=100 * fused_gbps / copy_gbps,
        exact=case.exact,
        equal=all(_equal(case.fused(*s), case.eager(*s)) for s in case.sets[:2]),
        max_abs_diff=max(_max_abs_diff(case.fused(*s), case.eager(*s)) for s in case.sets[:2]),
    )


def host_us_per_call(sh: Shapes, calls: int = 2000) -> dict[str, float]:
    """Host time to enqueue one call of the modulate in its forms (tiny tensors, so the GPU is never the limit)."""
    from .ops import modulate_scale_shift, modulate_scale_shift_ref

    x = torch.randn(1, 17, 64, device=sh.device, dtype=sh.dtype)
    shift, scale = torch.randn(1, 6 * 64, device=sh.device, dtype=sh.dtype).chunk(6, dim=1)[:2]
    ops = torch.ops.diffusers_fastpath
    candidates = {
        "x.add(1) (baseline)": lambda: x.add(1),
        "eager chain (3 kernels)": lambda: modulate_scale_shift_ref(x, scale, shift),
        "fused, direct CUDA op": lambda: ops._modulate_scale_shift_cuda.default(x, scale, shift),
        "fused, Python custom op": lambda: ops.modulate_scale_shift.default(x, scale, shift),
        "fused, public entry (guard + policy)": lambda: modulate_scale_shift(x, scale, shift),
    }
    out = {}
    for name, fn in candidates.items():
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return out


def run_kernels(subject: Subject, args: argparse.Namespace, device: torch.device, show: bool) -> dict[str, Any]:
    if device.type != "cuda":
        return dict(ran=False, reason="needs CUDA (the fused kernels are CUDA kernels)", rows=[], host_us_per_call={})
    from .ops._build import load_extension

    load_extension()
    cfg = subject.transformer.config
    hidden = cfg.num_attention_heads * cfg.attention_head_dim if subject.family == "flux" else cfg.hidden_size
    sh = Shapes(subject.family, subject.transformer, hidden, (args.height // 16) * (args.width // 16),
                args.text_tokens, args.batch, DTYPES[args.dtype], device)
    builders = list(KERNEL_CASES.values())
    rows = []
    with _progress(len(builders), "kernels", show) as bar:
        for build in builders:
            for case in build(sh):
                rows.append(_kernel_row(case))
                del case
            bar.update()
    return dict(ran=True, reason=None, rows=rows, host_us_per_call=host_us_per_call(sh))


# ---------------------------------------------------------------------------------------------------- the run


def _unavailable_row(name: str, reason: str) -> dict[str, Any]:
    return dict(mode=name, available=False, reason=reason)


class _Runner:
    """One benchmark run: the subject, the clock, and what each mode gave at each level."""

    def __init__(self, args: argparse.Namespace, subject: Subject, ctx: Context, modes_info: dict[str, dict]) -> None:
        self.args, self.subject, self.ctx, self.modes_info = args, subject, ctx, modes_info
        self.device = ctx.device
        self.clock = Clock(ctx.device)
        self.show = not args.no_progress and sys.stderr.isatty()
        self.step: dict[str, Samples] = {}
        self.gen: dict[str, Samples] = {}
        self.prof: dict[str, dict] = {}
        self.phases: dict[str, float] = {}

    def phase(self, name: str, t0: float) -> None:
        self.phases[name] = time.perf_counter() - t0
        print(f"[bench] {name}: {self.phases[name]:.1f} s", file=sys.stderr, flush=True)

    def failed(self, mode: Mode, exc: Exception) -> None:
        reason = f"failed: {type(exc).__name__}: {exc}".strip()
        logger.warning(f"diffusers_fastpath.bench: mode {mode.name} {reason}")
        self.modes_info[mode.name].update(available=False, reason=reason)
        for level in (self.step, self.gen, self.prof):
            level.pop(mode.name, None)

    def probe(self, modes: list[Mode]) -> list[Mode]:
        """The modes that apply and run one step; the others are reported as failed, with the error."""
        ok = []
        for mode in modes:
            try:
                with _applied(mode, self.subject.transformer, self.ctx):
                    self.clock.time(self.subject.step)
            except Exception as exc:  # noqa: BLE001 - one broken mode must not cost the whole run
                self.failed(mode, exc)
            else:
                ok.append(mode)
        return ok

    def plain_modes(self, modes: list[Mode], do_step: bool, do_gen: bool, do_prof: bool) -> None:
        """Every non-compiled mode, round-robin: each applied around each of its calls."""
        subject, clock, args = self.subject, self.clock, self.args
        if do_step or do_prof:
            t0 = time.perf_counter()
            if do_step:
                with _progress(args.repeats * len(modes), "step", self.show) as bar:
                    def body(mode: Mode, r: int) -> None:
                        _step_once(subject, clock, self.step.setdefault(mode.name, Samples()))
                        bar.update()

                    _round_robin(modes, args.repeats, subject.transformer, self.ctx, body)
            if do_prof:
                for mode in modes:
                    with _applied(mode, subject.transformer, self.ctx):
                        clock.time(subject.step)
                        self.prof[mode.name] = _profile_step(subject, clock)
            self.phase("step", t0)
        if do_gen:
            t0 = time.perf_counter()
            with _progress(args.gen_repeats * len(modes), "generation", self.show) as bar:
                def body(mode: Mode, r: int) -> None:
                    _generation_once(subject, args, self.device, clock, self.gen.setdefault(mode.name, Samples()))
                    bar.update()

                _round_robin(modes, args.gen_repeats, subject.transformer, self.ctx, body)
            self.phase("generation", t0)

    def compiled_mode(self, mode: Mode, do_step: bool, do_gen: bool, do_prof: bool) -> None:
        """One compiled mode, after ``torch._dynamo.reset()``: its first call is the compile time, then each level."""
        subject, clock, args = self.subject, self.clock, self.args
        t0 = time.perf_counter()
        torch._dynamo.reset()
        try:
            with _applied(mode, subject.transformer, self.ctx):
                c0 = time.perf_counter()
                if do_step or do_prof:
                    subject.step()
                else:
                    _generate(subject, args, self.device, steps=1)
                clock.sync()
                compile_s = time.perf_counter() - c0
                print(f"[bench] {mode.name}: compiled in {compile_s:.1f} s", file=sys.stderr, flush=True)
                if do_step:
                    samples = self.step[mode.name] = Samples(compile_s=compile_s)
                    with _progress(args.repeats, f"step {mode.name}", self.show) as bar:
                        for _ in range(args.repeats):
                            _step_once(subject, clock, samples)
                            bar.update()
                if do_prof:
                    self.prof[mode.name] = _profile_step(subject, clock)
                if do_gen:
                    samples = self.gen[mode.name] = Samples(compile_s=None if (do_step or do_prof) else compile_s)
                    for _ in range(args.gen_repeats):
                        _generation_once(subject, args, self.device, clock, samples)
        except Exception as exc:  # noqa: BLE001 - e.g. a backend that cannot compile this model here
            self.failed(mode, exc)
        finally:
            torch._dynamo.reset()
        self.phase(mode.name, t0)

    def rows(self, samples: dict[str, Samples], make_row) -> list[dict[str, Any]]:
        ref = samples.get("eager")
        out = []
        for name, info in self.modes_info.items():
            if not info["available"]:
                out.append(_unavailable_row(name, info["reason"]))
            elif name in samples:
                out.append(make_row(MODES[name], samples[name], ref))
        return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the arguments describe; returns the JSON-able result."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # CUDA events and the kernels level use the current device
    levels = args.levels
    ctx = Context(device, {k: v for k, v in (("backend", args.compile_backend), ("mode", args.compile_mode)) if v})
    modes_info = {}
    for name in args.modes:
        mode = MODES[name]
        reason = mode.unavailable(ctx)
        modes_info[name] = dict(description=mode.description, exact=mode.exact, compiled=mode.compiled,
                                available=reason is None, reason=reason)
    result: dict[str, Any] = dict(schema=SCHEMA, conditions=conditions(args, device), args=vars(args).copy(),
                                  levels=levels, modes=modes_info)

    t0 = time.perf_counter()
    need_pipe = "generation" in levels
    subject = build_subject(args, device, need_pipe)
    runner = _Runner(args, subject, ctx, modes_info)
    runner.phase("build", t0)
    do_step, do_prof = "step" in levels, "profile" in levels
    do_gen = need_pipe and subject.no_generation is None

    with torch.no_grad():
        if do_step or do_gen or do_prof:
            for _ in range(2):  # the process's first calls (allocator, cuBLAS handles, ...) count for no mode
                runner.clock.time(subject.step)
            available = [MODES[name] for name, info in modes_info.items() if info["available"]]
            plain = runner.probe([m for m in available if not m.compiled])
            if "eager" not in [m.name for m in plain]:
                raise RuntimeError(f"the eager reference failed: {modes_info['eager']['reason']}")
            runner.plain_modes(plain, do_step, do_gen, do_prof)
            for mode in available:
                if mode.compiled:
                    runner.compiled_mode(mode, do_step, do_gen, do_prof)

    result["step"] = dict(ran=do_step, reason=None if do_step else "not requested", repeats=args.repeats,
                          rows=runner.rows(runner.step, _step_row) if do_step else [])
    gen_reason = None if do_gen else ("not requested" if not need_pipe else subject.no_generation)
    result["generation"] = dict(ran=do_gen, reason=gen_reason, repeats=args.gen_repeats, steps=args.steps,
                                rows=runner.rows(runner.gen, _generation_row) if do_gen else [])
    result["profile"] = dict(ran=do_prof, reason=None if do_prof else "not requested",
                             rows=[dict(mode=name, **p) for name, p in runner.prof.items()])
    if "kernels" in levels:
        t0 = time.perf_counter()
        with torch.no_grad():
            result["kernels"] = run_kernels(subject, args, device, runner.show)
        runner.phase("kernels", t0)
    else:
        result["kernels"] = dict(ran=False, reason="not requested", rows=[], host_us_per_call={})
    result["phases_s"] = runner.phases
    return result


def violations(result: dict[str, Any]) -> list[str]:
    """What broke a promise: a mode that promises bit-identity and is not, a fused kernel unequal to its chain."""
    out = []
    for level in ("step", "generation"):
        for row in result[level]["rows"]:
            if row.get("available") and result["modes"][row["mode"]]["exact"] and row["bit_identical"] is False:
                out.append(f"{level}: mode {row['mode']} is not bit-identical to eager")
    for row in result["kernels"]["rows"]:
        if row.get("exact", True) and not row["equal"]:
            out.append(f"kernels: {row['op']} {tuple(row['shape'])} is not equal to its eager chain")
    return out


# ---------------------------------------------------------------------------------------------------- reporting


def _fmt(v: Any, spec: str = ".1f", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    return format(v, spec)


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def describe_conditions(c: dict[str, Any]) -> str:
    hw = f"{c['gpu']} (driver {c['driver'] or 'unknown'})" if c.get("gpu") else f"CPU ({c.get('cpu') or 'unknown'})"
    return (f"{hw}; torch {c['torch']} (CUDA {c['cuda']}), diffusers {c['diffusers']}, diffusers_fastpath "
            f"{c['diffusers_fastpath']}, commit `{c['commit']}`; model {c['model']}, {c['dtype']}, "
            f"{c['width']}x{c['height']}, batch {c['batch']}, {c['steps']} steps, {c['text_tokens']} text tokens; "
            f"{c['date']}")


def markdown(result: dict[str, Any]) -> str:
    """The report as markdown (what stdout gets, and what ``--from-json`` re-renders)."""
    lines = ["## diffusers_fastpath benchmark", "", describe_conditions(result["conditions"]), ""]

    def unavailable(row: dict[str, Any], width: int) -> list[str]:
        return [row["mode"], f"unavailable: {row['reason']}"] + [""] * (width - 2)

    step = result["step"]
    if step["ran"]:
        unit = "GPU ms" if result["conditions"].get("gpu") else "ms"
        lines += [f"### Transformer step (median of {step['repeats']}, warm-up excluded)", ""]
        header = ["mode", unit, "host ms", "vs eager", "peak GiB", "compile s", "bit-identical", "max abs diff",
                  "PSNR dB", "md5", "fused sites (fast/fallback)"]
        body = []
        for r in step["rows"]:
            if not r["available"]:
                body.append(unavailable(r, len(header)))
                continue
            fpath = r["fastpath"]
            body.append([r["mode"], _fmt(r["ms"], ".2f"), _fmt(r["host_ms"], ".2f"), _fmt(r["ratio"], ".3f"),
                         _fmt(r["peak_mem_gib"], ".2f"), _fmt(r["compile_s"]), _fmt(r["bit_identical"]),
                         _fmt(r["max_abs_diff"], ".3g"), _fmt(r["psnr_db"], ".1f"), f"`{r['md5'][:10]}`",
                         f"{fpath['sites']} ({fpath['fast']}/{fpath['fallback']})" if fpath else "-"])
        lines += _table(header, body) + [""]
        if any(not r.get("interleaved", True) for r in step["rows"] if r["available"]):
            lines += ["Compiled modes ran after the others (each after `torch._dynamo.reset()`); the rest ran "
                      "round-robin. Compile s is the first call.", ""]
    gen = result["generation"]
    if gen["ran"]:
        lines += [f"### Generation ({gen['steps']} steps + VAE decode, median of {gen['repeats']}, after a 1-step "
                  "warm-up)", ""]
        header = ["mode", "s", "vs eager", "peak GiB", "compile s", "bit-identical", "PSNR dB", "SSIM",
                  "latents md5", "image md5"]
        body = []
        for r in gen["rows"]:
            if not r["available"]:
                body.append(unavailable(r, len(header)))
                continue
            body.append([r["mode"], _fmt(r["s"], ".3f"), _fmt(r["ratio"], ".3f"), _fmt(r["peak_mem_gib"], ".2f"),
                         _fmt(r["compile_s"]), _fmt(r["bit_identical"]), _fmt(r["psnr_db"], ".1f"),
                         _fmt(r["ssim"], ".4f"), f"`{r['latents_md5'][:10]}`", f"`{r['image_md5'][:10]}`"])
        lines += _table(header, body) + [""]
    elif gen["reason"] != "not requested":
        lines += [f"Generation level: {gen['reason']}.", ""]
    prof = result["profile"]
    if prof["ran"] and prof["rows"]:
        unit = prof["rows"][0]["unit"]
        lines += [f"### Profile of one step ({unit}: count / ms per category)", ""]
        header = ["mode", "total", *CATEGORY_NAMES]
        body = [[p["mode"], f"{p['kernels']} / {p['ms']:.2f}",
                 *(f"{p['categories'][c]['count']} / {p['categories'][c]['ms']:.2f}" for c in CATEGORY_NAMES)]
                for p in prof["rows"]]
        lines += _table(header, body) + [""]
        idle_rows = [p for p in prof["rows"] if p.get("idle")]
        if idle_rows:
            lines += [f"GPU idle in the profiled step, between its first and last kernel (under the profiler, "
                      f"whose host overhead lengthens launch-bound gaps; gaps of {IDLE_GAP_US:g} µs or more listed by "
                      "the kernel that waited):", ""]
            lines += _table(["mode", "idle ms", "gaps", "longest waits (kernel: count / ms)"],
                            [[p["mode"], f"{p['idle']['ms']:.2f}", str(p["idle"]["gaps"]),
                              "; ".join(f"`{g['kernel'][:40]}`: {g['count']} / {g['ms']:.2f}"
                                        for g in p["idle"]["by_kernel"][:4])]
                             for p in idle_rows]) + [""]
        for p in prof["rows"]:
            if p.get("top"):
                lines += [f"<details><summary>{p['mode']}: the {len(p['top'])} kernels that took the most time</summary>",
                          ""]
                lines += _table(["kernel", "category", "count", "ms"],
                                [[f"`{t['name'][:90]}`", t["category"], str(t["count"]), f"{t['ms']:.2f}"]
                                 for t in p["top"]])
                lines += ["", "</details>", ""]
    kern = result["kernels"]
    if kern["ran"]:
        lines += ["### Fused kernels against their eager chains (inputs rotated past the L2; GB/s = bytes read + "
                  "written over time)", ""]
        header = ["op", "shape", "dtype", "eager µs", "fused µs", "speedup", "fused GB/s", "copy GB/s",
                  "% of copy", "equal"]
        body = [[r["op"], str(tuple(r["shape"])), r["dtype"], _fmt(r["eager_us"]), _fmt(r["fused_us"]),
                 f"{r['speedup']:.2f}x", _fmt(r["fused_GBps"], ".0f"), _fmt(r["copy_GBps"], ".0f"),
                 f"{r['pct_of_copy']:.0f}%", _fmt(r["equal"])] for r in kern["rows"]]
        lines += _table(header, body) + [""]
        if kern["host_us_per_call"]:
            lines += _table(["host cost per call", "µs"],
                            ([k, f"{v:.1f}"] for k, v in kern["host_us_per_call"].items())) + [""]
    elif kern["reason"] != "not requested":
        lines += [f"Kernels level: {kern['reason']}.", ""]
    for v in violations(result):
        lines.append(f"**FAILED: {v}**")
    return "\n".join(lines).rstrip() + "\n"


def _import_pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or pip install "
                           "'diffusers_fastpath[plot]')") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict[str, Any], path: str) -> None:
    """A PNG bar chart of time per mode (step and generation), each bar annotated with its ratio to eager and
    whether it is bit-identical."""
    plt = _import_pyplot()
    panels = [(level, key, unit) for level, key, unit in (("step", "ms", "ms per step"), ("generation", "s", "s"))
              if result[level]["ran"] and any(r["available"] for r in result[level]["rows"])]
    if not panels:
        raise RuntimeError("nothing to plot: the result has no step or generation timings")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (level, key, unit) in zip(axes[0], panels):
        rows = [r for r in result[level]["rows"] if r["available"]]
        names = [r["mode"] for r in rows]
        values = [r[key] for r in rows]
        colors = ["#4c72b0" if r["bit_identical"] in (True, None) else "#dd8452" for r in rows]
        bars = ax.bar(names, values, color=colors)
        for bar, r in zip(bars, rows):
            exact = "bit-identical" if r["bit_identical"] in (True, None) else (
                f"PSNR {r['psnr_db']:.1f} dB" if isinstance(r["psnr_db"], float) else "not identical")
            ratio = f"{r['ratio']:.3f}x" if r["ratio"] is not None else ""
            compiled = f"\ncompile {r['compile_s']:.0f} s" if r.get("compile_s") else ""
            ax.annotate(f"{ratio}\n{exact}{compiled}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(level)
        ax.set_ylim(0, max(values) * 1.3)
        ax.tick_params(axis="x", labelrotation=20)
    c = result["conditions"]
    fig.suptitle(f"{c['model']}, {c['dtype']}, {c['width']}x{c['height']}, batch {c['batch']}, {c['steps']} steps - "
                 f"{c.get('gpu') or 'CPU'}, torch {c['torch']}, commit {c['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- the command


def _parser() -> argparse.ArgumentParser:
    mode_help = "; ".join(f"{m.name}: {m.description}" for m in MODES.values())
    p = argparse.ArgumentParser(prog="python -m diffusers_fastpath.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-tiny",
                   help=f"{', '.join(FLUX_MODELS + ERNIE_MODELS)}, or a FLUX pipeline's Hub id or folder "
                        "(default: flux-tiny)")
    p.add_argument("--modes", help=f"comma-separated subset (default: every available one); eager is always "
                                   f"included. {mode_help}")
    p.add_argument("--levels", default="step,generation", help=f"comma-separated, of {', '.join(LEVELS)} "
                                                               "(default: step,generation)")
    p.add_argument("--kernels", action="store_true", help="add the kernels level (fused ops against eager chains)")
    p.add_argument("--profile", action="store_true", help="add the profile level (one step per mode, by category)")
    p.add_argument("--height", type=int, help="pixels, a multiple of 16 (default: 1024; 128 for the tiny models)")
    p.add_argument("--width", type=int, help="pixels, a multiple of 16 (default: 1024; 128 for the tiny models)")
    p.add_argument("--steps", type=int, help="denoising steps of a generation (default: 28; 4 for the tiny models)")
    p.add_argument("--batch", type=int, default=1, help="images per call (default: 1)")
    p.add_argument("--text-tokens", type=int,
                   help="prompt tokens (default: 512 for FLUX, as FLUX.1-dev's T5 gives; 120 for ERNIE-Image)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per mode (default: 10)")
    p.add_argument("--gen-repeats", type=int, default=1, help="timed generations per mode (default: 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world",
                   help="prompt for a real model's text encoders")
    p.add_argument("--compile-backend", help="torch.compile backend (default: torch's, inductor)")
    p.add_argument("--compile-mode", help="torch.compile mode (e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--json", metavar="PATH", help="write every number (and the conditions) here")
    p.add_argument("--markdown", metavar="PATH", help="also write the markdown report here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--from-json", metavar="PATH", help="re-render the report (and --plot) of a saved run; runs nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (they go to stderr, on a TTY)")
    return p


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    tiny = args.model in ("flux-tiny", "ernie-image-tiny")
    ernie = args.model in ERNIE_MODELS
    args.height = args.height or (128 if tiny else 1024)
    args.width = args.width or (128 if tiny else 1024)
    args.steps = args.steps or (4 if tiny else 28)
    args.text_tokens = args.text_tokens or (120 if ernie else 512)
    for name in ("height", "width"):
        if getattr(args, name) <= 0 or getattr(args, name) % 16:
            p.error(f"--{name} must be a positive multiple of 16 (the VAE's 8x and the 2x2 patches), "
                    f"got {getattr(args, name)}")
    for name in ("steps", "batch", "text_tokens", "repeats", "gen_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    known = args.model in FLUX_MODELS + ERNIE_MODELS
    if not known and not (os.path.isdir(args.model) or re.fullmatch(r"[\w.-]+/[\w.-]+", args.model)):
        p.error(f"--model {args.model!r}: give one of {', '.join(FLUX_MODELS + ERNIE_MODELS)}, a local folder or "
                "a Hub id (owner/name)")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here (use --device cpu)")
    levels = _split(args.levels) + ["kernels"] * args.kernels + ["profile"] * args.profile
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        p.error(f"--levels: unknown level(s) {', '.join(unknown)}; known: {', '.join(LEVELS)}")
    args.levels = [lv for lv in LEVELS if lv in levels]
    if not args.levels:
        p.error("--levels: nothing to run")
    modes = _split(args.modes) or [
        m.name for m in MODES.values() if not (m.compiled and device.type == "cpu" and not args.compile_backend)
    ]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    modes = ["eager"] + [m for m in modes if m != "eager"]
    args.modes = [m for m in MODES if m in modes]  # registry order
    if args.plot:
        try:
            _import_pyplot()
        except RuntimeError as exc:  # before the run, not after an hour of GPU time
            p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark command; returns the exit status (0 ok, 1 a promise of bit-identity broken)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.from_json:
        try:
            result = json.loads(Path(args.from_json).read_text())
        except (OSError, ValueError) as exc:
            p.error(f"--from-json {args.from_json}: {exc}")
        if result.get("schema") != SCHEMA:
            p.error(f"--from-json {args.from_json}: not a benchmark result of schema {SCHEMA}")
    else:
        _check_args(p, args)
        logger.info(f"diffusers_fastpath.bench: {args.model}, modes {args.modes}, levels {args.levels}")
        result = run(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    report = markdown(result)
    print(report, end="")
    if args.markdown:
        Path(args.markdown).write_text(report)
    if args.plot:
        try:
            plot(result, args.plot)
        except RuntimeError as exc:
            p.error(str(exc))
    return 1 if violations(result) else 0


if __name__ == "__main__":
    sys.exit(main())
