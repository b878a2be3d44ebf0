"""The benchmark's GPU readings (``--sensors``, bench/sensors.py): the sampling thread reads only inside a timed
call's window and summarises what it read; the step rows and the report carry each mode's readings; without NVML
(a CPU machine) the run goes on and says why. A fake reader stands for NVML on CPU."""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time

import pytest
import torch

from diffusers_fastpath import bench
from diffusers_fastpath.bench import sensors as sensors_mod
from diffusers_fastpath.bench.sensors import POWER_REASONS, Readings, Sensors

TINY = ["--model", "flux-tiny", "--device", "cpu", "--height", "64", "--width", "64", "--steps", "2",
        "--text-tokens", "8", "--no-progress", "--levels", "step", "--repeats", "2", "--modes", "lossless"]


class FakeReader:
    """Readings that change with every query (so the summary is computed from them), with a power-cap reason on every
    other reading; counts its queries, and where they happened."""

    def __init__(self) -> None:
        self.n = itertools.count()
        self.queries = 0
        self.open = threading.Event()  # set by the test around the windows it opens

    def sm_mhz(self) -> int:
        self.queries += 1
        return 1500 + next(self.n) % 7 * 10

    def power_w(self) -> float:
        return 500.0 + self.queries % 3

    def temp_c(self) -> int:
        return 40 + self.queries % 5

    def reasons(self) -> int:
        return 0x4 if self.queries % 2 else 0x1  # SW power cap / GPU idle

    def limits(self):
        return dict(max_sm_mhz=1980, power_limit_w=700.0)


def test_readings_only_inside_windows_and_their_summary():
    reader = FakeReader()
    s = Sensors(reader, interval=0.001)
    try:
        time.sleep(0.02)
        assert reader.queries == 0  # no window open: nothing read
        r = Readings()
        with s.window(r):
            time.sleep(0.05)
        n = len(r.sm_mhz)
        time.sleep(0.02)
        assert n >= 5 and len(r.sm_mhz) == n == len(r.power_w) == len(r.temp_c) == len(r.reasons)  # none after it
    finally:
        s.close()
    summary = r.summary()
    assert summary["samples"] == n
    assert summary["sm_mhz_median"] == statistics.median(r.sm_mhz)
    assert summary["sm_mhz_min"] == min(r.sm_mhz) and summary["power_w_max"] == max(r.power_w)
    assert summary["power_capped"] == pytest.approx(sum(bool(x & POWER_REASONS) for x in r.reasons) / n)
    assert 0 < summary["power_capped"] < 1 and summary["thermal"] == 0
    assert Readings().summary() == dict(samples=0)


def test_a_query_that_fails_stops_the_readings_and_is_reported():
    class Failing(FakeReader):
        def power_w(self):
            raise RuntimeError("nvmlDeviceGetPowerUsage returned NVML error 3")

    s = Sensors(Failing(), interval=0.001)
    with s.window(Readings()):
        time.sleep(0.02)
    s.close()
    assert "NVML error 3" in s.error


def test_sensors_need_a_gpu_and_nvml():
    sensors, reason = Sensors.open(torch.device("cpu"))
    assert sensors is None and reason == "device cpu: no GPU to read"


def test_run_with_sensors_puts_each_modes_readings_in_its_row_and_the_report(monkeypatch, tmp_path, capsys):
    reader = FakeReader()
    monkeypatch.setattr(Sensors, "open", classmethod(lambda cls, device: (cls(reader, interval=0.0005), None)))
    rc = bench.main([*TINY, "--sensors", "--json", str(tmp_path / "r.json")])
    report = capsys.readouterr().out
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["sensors"]["ran"] and result["sensors"]["limits"] == reader.limits()
    for row in result["step"]["rows"]:
        s = row["sensors"]
        assert s["samples"] >= 1 and 1500 <= s["sm_mhz_min"] <= s["sm_mhz_median"] <= 1560, row["mode"]
    assert "GPU during the timed steps" in report and "power limit 700 W" in report
    assert bench.markdown(result) == report  # --from-json renders the same


def test_run_without_nvml_goes_on_and_says_why(capsys, tmp_path):
    rc = bench.main([*TINY, "--sensors", "--json", str(tmp_path / "r.json")])
    report = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and not result["sensors"]["ran"]
    assert all(row["sensors"] is None for row in result["step"]["rows"])
    assert "Sensors: device cpu: no GPU to read." in report


def test_without_the_flag_nothing_is_read(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(Sensors, "open", classmethod(lambda cls, device: pytest.fail("opened without --sensors")))
    assert bench.main([*TINY, "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["sensors"] == dict(ran=False, reason="not requested", interval_ms=sensors_mod.INTERVAL_S * 1e3,
                                     limits=None)
    assert "Sensors" not in capsys.readouterr().out


@pytest.mark.gpu
def test_nvml_reads_this_gpu():
    """On a GPU machine: NVML opens by the device's UUID and its readings are plausible."""
    sensors, reason = Sensors.open(torch.device("cuda", torch.cuda.current_device()))
    assert sensors is not None, reason
    try:
        r = Readings()
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        with sensors.window(r):
            for _ in range(50):
                x @ x
            torch.cuda.synchronize()
        s = r.summary()
        assert s["samples"] > 0 and 0 < s["sm_mhz_median"] <= sensors.limits["max_sm_mhz"] and s["power_w_mean"] > 0
    finally:
        sensors.close()
