"""The examples the README points to run on a CPU machine with nothing downloaded, and say what they promise; every
example and developer tool answers ``--help`` without running or building anything."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every script a user or contributor runs by hand (``_pipeline.py`` is the examples' shared module, not a script)
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for folder in ("examples", "tools") for p in (ROOT / folder).glob("*.py")
                 if not p.name.startswith("_"))
TORCHVISION_NOTICE = "requires torchvision"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra}


def run_example(name: str, *args: str) -> str:
    """The example on a CPU, as on a machine without a GPU (also where there is one: the report's first line is then
    the CPU machine's)."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300, env=_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if importlib.util.find_spec("torchvision") is None:  # where transformers would log its PIL fallback notice
        assert TORCHVISION_NOTICE not in proc.stderr, proc.stderr
    return proc.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess environment")
def test_lossless_example_is_bit_identical_on_cpu():
    out = run_example("flux_lossless.py", "--height", "64", "--width", "64", "--steps", "2")
    assert "bit-identical: True" in out and "quality=lossless" in out
    assert "no fused kernel ran" in out and "x, one run each" not in out  # no time ratio where no kernel ran
    assert "diffusers_fastpath: no CUDA kernels run here (" in out  # the report's first line, as the README says


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


def test_the_developer_tools_are_out_of_the_examples():
    """examples/ is for users; the probes and measurements that answer a contributor's question live in tools/."""
    examples = {p.name for p in (ROOT / "examples").iterdir()}
    assert not {n for n in examples if "probe" in n or n.endswith(".cu")}, examples
    assert {"tools/attention_layout_probe.py", "tools/kernel_layout_probe.py",
            "tools/measure_chain_rewrite.py"} <= set(SCRIPTS)
    assert (ROOT / "tools" / "kernel_layout_probe.cu").is_file()


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess environment")
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_example_and_tool_answers_help_without_running(script, tmp_path):
    """``--help`` prints the usage and exits 0 on a CPU machine: no benchmark run (measure_chain_rewrite.py used to run
    for 285 s), no GPU demanded first (the two layout probes refused), nothing built (the kernels' cache stays
    empty). Each answers in seconds (most of it importing torch and diffusers); the timeout only guards against a
    script that does its work instead."""
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120,
                          env=_env(DIFFUSERS_FASTPATH_CACHE=str(cache), CUDA_VISIBLE_DEVICES=""), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage:" in proc.stdout and "[bench]" not in proc.stderr
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.skipif(sys.platform == "win32", reason="subprocess environment")
@pytest.mark.parametrize("args", [[], ["--model", "flux-dev"], ["--model=chroma", "--modes", "eager,lossless"]])
def test_benchmark_example_refuses_a_full_size_model_on_a_cpu_unless_asked(args, tmp_path):
    """Without a GPU, examples/benchmark_flux.py says what it would build and how to run something that fits, and
    exits 2 before building anything (it used to build FLUX.1-dev on the CPU until memory ran out)."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "benchmark_flux.py"), *args], capture_output=True,
                          text=True, timeout=60, env=_env(CUDA_VISIBLE_DEVICES=""), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU here" in proc.stderr and "--model flux-tiny" in proc.stderr and "--device cpu" in proc.stderr
    assert "[bench]" not in proc.stderr
