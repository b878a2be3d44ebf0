"""The step level: one transformer forward per call, timed after a warm-up, and its row of the report."""

from __future__ import annotations

import statistics
from typing import Any

from ...metrics import psnr
from ..modes import Mode, fastpath_summary
from ..sensors import Readings
from ..subject import Subject
from ..timing import Clock, Samples, equal, finite, max_abs_diff, md5


def step_once(subject: Subject, clock: Clock, samples: Samples) -> None:
    clock.reset_peak()
    clock.time(subject.step)  # warm-up: the first call after patching builds caches (rotary table, ...)
    if samples.first_peak_gib is None:  # the first call of the mode: a patched model verifies its forward there
        samples.first_peak_gib = clock.peak_gib()
    clock.reset_peak()
    if clock.sensors is not None and samples.readings is None:
        samples.readings = Readings()
    out, ms, host_ms = clock.time(subject.step, samples.readings)
    samples.add(out, ms, host_ms, clock.peak_gib())
    if samples.fastpath is None:
        samples.fastpath = fastpath_summary(subject.transformer)


def step_row(mode: Mode, s: Samples, ref: Samples | None) -> dict[str, Any]:
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
        first_peak_mem_gib=s.first_peak_gib,
        compile_s=s.compile_s,
        md5=md5(s.out),
        bit_identical=equal(s.out, ref.out) if ref is not None else None,
        max_abs_diff=max_abs_diff(out, eager_out) if ref is not None else None,
        psnr_db=finite(psnr(out, eager_out, data_range=data_range)) if ref is not None else None,
        repeatable=s.repeatable,
        interleaved=not mode.compiled,
        fastpath=s.fastpath,
        sensors=s.readings.summary() if s.readings is not None else None,
    )
