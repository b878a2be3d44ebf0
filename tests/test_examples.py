"""The examples the README points to run on a CPU machine with nothing downloaded, and say what they promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess environment")
def test_lossless_example_is_bit_identical_on_cpu():
    out = run_example("flux_lossless.py", "--height", "64", "--width", "64", "--steps", "2")
    assert "bit-identical: True" in out and "quality=lossless" in out
    assert "no fused kernel ran" in out and "x, one run each" not in out  # no time ratio where no kernel ran


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess environment")
@pytest.mark.parametrize("family, pipeline", [("chroma", "ChromaPipeline"), ("flux2", "Flux2Pipeline")])
def test_lossless_example_takes_another_family_offline(family, pipeline):
    out = run_example("flux_lossless.py", "--family", family, "--height", "64", "--width", "64", "--steps", "2")
    assert f"tiny random {pipeline} on cpu" in out and "bit-identical: True" in out and "quality=lossless" in out


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess environment")
def test_high_quality_example_reports_the_tier_on_cpu():
    out = run_example("flux_high_quality.py", "--height", "64", "--width", "64", "--steps", "2")
    assert "lossless identical to unpatched: True" in out and "after the context: identical to unpatched: True" in out
    assert "quality=high" in out  # the report printed inside the context
    assert "lossless:  md5" in out and "(no fused kernel ran)" in out and " ms, " not in out
