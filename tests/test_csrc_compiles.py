"""Compile-only check of csrc/ on a machine without a GPU: catches a broken kernel before it reaches one.

nvcc builds each kernel for sm_90 exactly as the JIT build does (no torch headers in the .cu files); the host
compiler builds the torch bindings against the installed torch's headers. Nothing is linked or run here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from diffusers_fastpath.ops import _build



def _cuda_home() -> Path | None:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "include" / "cuda_runtime.h").exists():
            return Path(candidate)
    nvcc = shutil.which("nvcc")
    home = Path(nvcc).resolve().parent.parent if nvcc else None
    return home if home and (home / "include" / "cuda_runtime.h").exists() else None


CUDA_HOME = _cuda_home()
NVCC = str(CUDA_HOME / "bin" / "nvcc") if CUDA_HOME and (CUDA_HOME / "bin" / "nvcc").exists() else shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None or CUDA_HOME is None, reason="the CUDA toolkit (nvcc) is not installed")


@pytest.mark.parametrize("source", [p.name for p in _build.sources() if p.suffix == ".cu"])
def test_kernel_compiles_for_sm90(source, tmp_path):
    cmd = [
        NVCC, "-c", str(_build.csrc_dir() / source), "-o", str(tmp_path / "k.o"), "-std=c++17",
        "-gencode=arch=compute_90,code=sm_90", *_build._CUDA_FLAGS, f"-I{_build.csrc_dir()}",
        # the flags torch.utils.cpp_extension adds to every CUDA source
        "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr", "-Xptxas", "-v",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "spill stores" in proc.stderr and " 0 bytes spill stores" in proc.stderr  # nothing spilled to local memory


@pytest.mark.parametrize("source", [p.name for p in _build.sources() if p.suffix == ".cpp"])
def test_bindings_compile_against_torch_headers(source, tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    includes = [*torch.utils.cpp_extension.include_paths(), str(CUDA_HOME / "include"), str(_build.csrc_dir())]
    # CPU wheels of torch ship c10/cuda's headers but not the one header CMake generates for CUDA builds.
    generated = Path(includes[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not generated.exists():
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path / "stub"))
    cmd = [cxx, "-c", str(_build.csrc_dir() / source), "-o", str(tmp_path / "b.o"), "-std=c++20", "-fPIC",
           "-O1", *(f"-I{p}" for p in includes)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
