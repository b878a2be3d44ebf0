"""The generation level: a whole pipeline call (VAE decode included) per timed call, and its row of the report."""

from __future__ import annotations

import statistics
import time
from typing import Any

from ...metrics import psnr, ssim
from ..modes import Mode, fastpath_summary
from ..subject import Subject, generate
from ..timing import Clock, Samples, equal, finite, max_abs_diff, md5


def generation_once(subject: Subject, args, device, clock: Clock, samples: Samples) -> None:
    clock.reset_peak()
    t0 = time.perf_counter()
    generate(subject, args, device, steps=1)  # warm-up
    clock.sync()
    samples.warmup_s = samples.warmup_s or time.perf_counter() - t0
    out, ms, host_ms = clock.time(lambda: generate(subject, args, device, steps=args.steps))
    samples.add((out["latents"], out["image"]), ms, host_ms, clock.peak_gib())
    if samples.fastpath is None:
        samples.fastpath = fastpath_summary(subject.transformer)


def generation_row(mode: Mode, s: Samples, ref: Samples | None) -> dict[str, Any]:
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
        row["latents_identical"] = equal(latents, ref_latents)
        row["image_identical"] = equal(image, ref_image)
        row["bit_identical"] = row["latents_identical"] and row["image_identical"]
        row["max_abs_diff_latents"] = max_abs_diff(latents.float(), ref_latents.float())
        row["psnr_db"] = finite(psnr(image, ref_image))
        row["ssim"] = ssim(image, ref_image)
    return row
