"""What the GPU did while a step was timed: its SM clock, power draw, temperature and the reasons NVML gives for a
clock below its maximum, read on a thread every few milliseconds (``--sensors``). Read only: nothing here sets a
clock, a power limit or any other setting of the card.

Why: a fused step runs the same GEMMs with less time between them, so the card can spend more of it at its power
limit, where the SM clock drops and each GEMM takes longer (FLUX.2-dev at 1024x1024: lossless's 203 GEMM launches
took 366.8 ms of kernel time against eager's 342.1, the same kernels). The readings say whether a mode's step ran at
a lower clock, and whether NVML called it power capping or heat.

NVML is the driver's own library (``libnvidia-ml.so.1`` / ``nvml.dll``), reached through ctypes: no package to
install. Where it cannot be opened the run goes on without readings and says why.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

INTERVAL_S = 0.002

# nvmlClocksEventReasons bits (nvml.h): what holds the clock below its maximum
POWER_REASONS = 0x4 | 0x8 | 0x80  # SW power cap, HW slowdown, HW power brake
THERMAL_REASONS = 0x20 | 0x40  # SW thermal slowdown, HW thermal slowdown


class Reader(Protocol):
    """One GPU's NVML readings (`Nvml`; tests give a fake)."""

    def sm_mhz(self) -> int: ...

    def power_w(self) -> float: ...

    def temp_c(self) -> int: ...

    def reasons(self) -> int: ...

    def limits(self) -> dict[str, Any]: ...


class Nvml:
    """NVML's read-only queries of the GPU torch calls `device`, through ctypes."""

    def __init__(self, device: torch.device) -> None:
        name = "nvml.dll" if sys.platform == "win32" else "libnvidia-ml.so.1"
        self.lib = ctypes.CDLL(name)
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        # by UUID: CUDA's device numbering (CUDA_VISIBLE_DEVICES, its ordering) need not be NVML's
        uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}".encode()
        if self.lib.nvmlDeviceGetHandleByUUID(ctypes.c_char_p(uuid), ctypes.byref(self.handle)) != 0:
            self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(device.index or 0),
                                                               ctypes.byref(self.handle)), "nvmlDeviceGetHandle")
        self.reasons()  # fails here, not on the sampling thread, where the driver lacks a query

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned NVML error {status}")

    def _uint(self, fn: str, *args) -> int:
        v = ctypes.c_uint()
        self._check(getattr(self.lib, fn)(self.handle, *args, ctypes.byref(v)), fn)
        return v.value

    def sm_mhz(self) -> int:
        return self._uint("nvmlDeviceGetClockInfo", ctypes.c_int(1))  # NVML_CLOCK_SM

    def power_w(self) -> float:
        return self._uint("nvmlDeviceGetPowerUsage") / 1e3  # mW

    def temp_c(self) -> int:
        return self._uint("nvmlDeviceGetTemperature", ctypes.c_int(0))  # NVML_TEMPERATURE_GPU

    def reasons(self) -> int:
        v = ctypes.c_ulonglong()
        for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if hasattr(self.lib, fn):
                self._check(getattr(self.lib, fn)(self.handle, ctypes.byref(v)), fn)
                return v.value
        raise RuntimeError("this NVML has no clocks-event-reasons query")

    def limits(self) -> dict[str, Any]:
        return dict(max_sm_mhz=self._uint("nvmlDeviceGetMaxClockInfo", ctypes.c_int(1)),
                    power_limit_w=self._uint("nvmlDeviceGetEnforcedPowerLimit") / 1e3)


@dataclass
class Readings:
    """The samples of one mode's timed calls."""

    sm_mhz: list[int] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    temp_c: list[int] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        n = len(self.sm_mhz)
        if not n:
            return dict(samples=0)
        return dict(samples=n, sm_mhz_median=statistics.median(self.sm_mhz), sm_mhz_min=min(self.sm_mhz),
                    power_w_mean=statistics.fmean(self.power_w), power_w_max=max(self.power_w),
                    temp_c_max=max(self.temp_c),
                    power_capped=sum(bool(r & POWER_REASONS) for r in self.reasons) / n,
                    thermal=sum(bool(r & THERMAL_REASONS) for r in self.reasons) / n)


class Sensors:
    """A sampling thread that reads `reader` every `interval` seconds while a `window` is open, into that window's
    `Readings`. ``Sensors.open(device)`` gives ``(sensors, None)`` or ``(None, why not)``."""

    def __init__(self, reader: Reader, interval: float = INTERVAL_S) -> None:
        self.reader, self.interval = reader, interval
        self.limits = reader.limits()
        self._into: Readings | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="diffusers_fastpath-sensors", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, device: torch.device) -> tuple[Sensors | None, str | None]:
        if device.type != "cuda":
            return None, f"device {device.type}: no GPU to read"
        try:
            return cls(Nvml(device)), None
        except (OSError, RuntimeError, AttributeError) as exc:
            return None, f"NVML unavailable: {exc}"

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                into = self._into
                if into is not None:
                    try:
                        r = self.reader
                        into.sm_mhz.append(r.sm_mhz())
                        into.power_w.append(r.power_w())
                        into.temp_c.append(r.temp_c())
                        into.reasons.append(r.reasons())
                    except (OSError, RuntimeError) as exc:  # a query that stopped working: no more readings
                        self.error = f"{type(exc).__name__}: {exc}"
                        self._stop.set()
            time.sleep(self.interval)

    def window(self, into: Readings) -> _Window:
        return _Window(self, into)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


class _Window:
    def __init__(self, sensors: Sensors, into: Readings) -> None:
        self.sensors, self.into = sensors, into

    def __enter__(self) -> Readings:
        with self.sensors._lock:
            self.sensors._into = self.into
        return self.into

    def __exit__(self, *exc) -> None:
        with self.sensors._lock:
            self.sensors._into = None
