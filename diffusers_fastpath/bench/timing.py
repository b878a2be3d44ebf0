"""Timing one call (`Clock`), what a mode gave (`Samples`), and comparing outputs (equality, md5, max abs diff)."""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class Clock:
    """Times one call: device time (CUDA events; wall time on CPU) and host time until the call returns; with
    `sensors` (`bench.sensors.Sensors`) and a call's `readings`, what the GPU reported while that call ran."""

    def __init__(self, device: torch.device, sensors: Any = None) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.sensors = sensors

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any], readings: Any = None) -> tuple[Any, float, float]:
        """``(result, ms, host_ms)``."""
        if readings is not None and self.sensors is not None:
            with self.sensors.window(readings):
                return self._time(fn)
        return self._time(fn)

    def _time(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
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
    peak_gib: float | None = None  # the timed calls' peak (allocated), the warm-ups' left out
    first_peak_gib: float | None = None  # the mode's first call's (a patched model's verification forward runs there)
    out: Any = None  # the first timed call's output (the exactness check compares it with eager's)
    repeatable: bool = True  # every timed call gave the same output as the first
    compile_s: float | None = None
    warmup_s: float | None = None
    fastpath: dict[str, int] | None = None
    readings: Any = None  # bench.sensors.Readings of the timed calls, with --sensors
    parts: list[dict[str, Any]] = field(default_factory=list)  # per timed call: its parts (the generation's split)

    def add(self, out: Any, ms: float, host_ms: float, peak: float | None) -> None:
        if self.out is None:
            self.out = out
        else:
            self.repeatable = self.repeatable and equal(out, self.out)
        self.ms.append(ms)
        self.host_ms.append(host_ms)
        if peak is not None:
            self.peak_gib = max(self.peak_gib or 0.0, peak)


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    import numpy as np

    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def md5(x: Any) -> str:
    """md5 of the raw bytes of a tensor (any dtype, bf16 included) or a numpy array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.md5(x.tobytes()).hexdigest()


def max_abs_diff(a: Any, b: Any) -> float:
    if isinstance(a, (tuple, list)):  # ops with several outputs (the gated RMSNorm: residual and normed)
        return max((max_abs_diff(x, y) for x, y in zip(a, b)), default=0.0)
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    return (a.double() - b.to(a.device).double()).abs().max().item() if a.numel() else 0.0  # on a's device


def finite(x: float | None) -> float | str | None:
    """JSON has no infinity: identical outputs have PSNR "inf"."""
    return "inf" if x is not None and math.isinf(x) else x


def progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, leave=False, dynamic_ncols=True)
