"""The generation level: a whole pipeline call (VAE decode included) per timed call, split into its parts, and its row
of the report.

The split (`split_parts`) of each timed call: text encoding (the pipeline's ``encode_prompt``; with prompt embeddings
given it encodes nothing and only passes them on), denoising (the loop the pipeline runs inside ``with
self.progress_bar(...)``: every transformer step with its scheduler step and step-end callback) and decode
(``vae.decode``), each the span between two marks of that call: CUDA events on the current stream on a GPU,
``perf_counter`` on a CPU (host clock). "Other" is what the end-to-end time holds besides: the latents' preparation,
unpacking and scaling, the image's post-processing and its copy to the host. The marks are set by wrappers put on the
pipeline instance (``encode_prompt``, ``progress_bar``) and on the VAE instance (``decode``) around the timed call
only, and taken off after it: no module hook is registered and no ``forward`` is replaced, so what the fused ops ask
before they run (`ops._policy.hooked`: the VAE's GroupNorm pairs, FLUX.1's hand-offs between blocks), the CUDA graphs'
model fingerprint and a compiled transformer's graph are the same as without the bench, and so is every number.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from typing import Any, Callable, Iterator

import torch

from ...metrics import psnr, ssim
from ..modes import Mode, fastpath_summary
from ..subject import Subject, generate
from ..timing import Clock, Samples, equal, finite, max_abs_diff, md5

PARTS = ("text", "denoise", "decode")
_MISSING = object()


class _Marks:
    """Points in time of one call: CUDA events recorded on the current stream (read after the call's end event has
    completed), or the host clock on a CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


class _Bracket:
    """The progress bar a pipeline's denoising loop runs in (``with self.progress_bar(total=...) as bar``, or ``for
    t in self.progress_bar(timesteps)``), marking where the loop starts and ends; everything else is the bar's."""

    def __init__(self, bar: Any, spans: list, marks: _Marks) -> None:
        self._bar, self._spans, self._marks = bar, spans, marks

    def __enter__(self) -> Any:
        self._start = self._marks.now()
        return self._bar.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self._spans.append((self._start, self._marks.now()))
        return self._bar.__exit__(*exc)

    def __iter__(self) -> Iterator[Any]:
        start = self._marks.now()
        yield from self._bar
        self._spans.append((start, self._marks.now()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


@contextlib.contextmanager
def split_parts(pipe: Any, cuda: bool) -> Iterator[Callable[[], dict[str, float | None]]]:
    """Mark the parts of the pipeline calls made inside the block (see the module doc); yields ``split()``: each
    part's milliseconds over those calls (None for a part that did not run: no VAE call with ``output_type=
    "latent"``), to be read once the calls' work is done (after `Clock.time`, which waits for its end event)."""
    marks = _Marks(cuda)
    spans: dict[str, list] = {part: [] for part in PARTS}

    def timed(part: str, fn: Callable) -> Callable:
        @functools.wraps(fn)  # keeps the signature, which pipelines inspect on some methods
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = marks.now()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[part].append((start, marks.now()))

        return wrapper

    def bracketed(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> _Bracket:
            return _Bracket(fn(*args, **kwargs), spans["denoise"], marks)

        return wrapper

    vae = getattr(pipe, "vae", None)
    installed = []
    try:
        for owner, name, wrap in ((pipe, "encode_prompt", functools.partial(timed, "text")),
                                  (pipe, "progress_bar", bracketed),
                                  (vae, "decode", functools.partial(timed, "decode"))):
            fn = getattr(owner, name, None) if owner is not None else None
            if callable(fn):  # an instance attribute, set in the instance's dict (no __setattr__ logic runs)
                installed.append((owner, name, owner.__dict__.get(name, _MISSING)))
                owner.__dict__[name] = wrap(fn)
        yield lambda: {part: sum(marks.ms(a, b) for a, b in spans[part]) if spans[part] else None for part in PARTS}
    finally:
        for owner, name, prior in reversed(installed):
            if prior is _MISSING:
                del owner.__dict__[name]
            else:
                owner.__dict__[name] = prior


def generation_once(subject: Subject, args, device, clock: Clock, samples: Samples) -> None:
    clock.reset_peak()
    t0 = time.perf_counter()
    generate(subject, args, device, steps=1)  # warm-up
    clock.sync()
    samples.warmup_s = samples.warmup_s or time.perf_counter() - t0
    with split_parts(subject.pipe, clock.cuda) as split:
        out, ms, host_ms = clock.time(lambda: generate(subject, args, device, steps=args.steps))
        parts = split()
    samples.add((out["latents"], out["image"]), ms, host_ms, clock.peak_gib())
    samples.parts.append(dict(parts, total=ms, text_encoded=not subject.embeddings_given, cuda=clock.cuda))
    if samples.fastpath is None:
        samples.fastpath = fastpath_summary(subject.pipe)  # the pipeline's patched models: transformer, VAE, ...


def _median_call(ms: list[float]) -> int:
    """The index of the call whose time is the median (the lower middle one of an even count)."""
    order = sorted(range(len(ms)), key=ms.__getitem__)
    return order[(len(order) - 1) // 2]


def time_split(s: Samples) -> dict[str, Any]:
    """The split of the call with the median end-to-end time: its parts, and "other", the rest of that call, so the
    parts and other add up to its end-to-end time."""
    p = s.parts[_median_call(s.ms)]
    ran = [p[part] for part in PARTS if p[part] is not None]
    return dict(clock="CUDA events" if p["cuda"] else "host clock (CPU)", text_encoded=p["text_encoded"],
                text_ms=p["text"], denoise_ms=p["denoise"], decode_ms=p["decode"], other_ms=p["total"] - sum(ran),
                total_ms=p["total"])


def split_ratio(split: dict[str, Any], ref: dict[str, Any]) -> dict[str, float | None]:
    """Each part's time against eager's (None where either did not run or eager's took no time)."""
    return {key[:-3]: split[key] / ref[key] if split[key] is not None and ref[key] else None
            for key in ("text_ms", "denoise_ms", "decode_ms", "other_ms", "total_ms")}


def generation_row(mode: Mode, s: Samples, ref: Samples | None) -> dict[str, Any]:
    ms = statistics.median(s.ms)
    latents, image = s.out
    split = time_split(s)
    row = dict(
        mode=mode.name,
        available=True,
        reason=None,
        s=ms / 1e3,
        s_all=[m / 1e3 for m in s.ms],
        host_s=statistics.median(s.host_ms) / 1e3,
        ratio=ms / statistics.median(ref.ms) if ref is not None else None,
        split=split,
        split_ratio=split_ratio(split, time_split(ref)) if ref is not None else None,
        split_all=[{k: p[k] for k in (*PARTS, "total")} for p in s.parts],
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
        row["latents_identical"] = equal(latents, ref_latents)
        row["image_identical"] = equal(image, ref_image)
        row["bit_identical"] = row["latents_identical"] and row["image_identical"]
        row["max_abs_diff_latents"] = max_abs_diff(latents.float(), ref_latents.float())
        row["psnr_db"] = finite(psnr(image, ref_image))
        row["ssim"] = ssim(image, ref_image)
    return row
