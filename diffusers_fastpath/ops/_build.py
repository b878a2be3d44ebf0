"""JIT build of the CUDA sources in ``csrc/`` into one torch extension.

The extension is built on the first CUDA call of any fused op with ``torch.utils.cpp_extension.load`` and ninja,
for the architecture of the GPU that is present only, and cached on disk in a directory named by a hash of the
sources, the build flags, the torch and CUDA versions and the GPU architecture: a changed kernel, another torch or
another GPU gets a fresh build, an unchanged one loads in well under a second. The kernels are compiled by nvcc
without torch's headers (``csrc/fastpath.h`` is the plain-C++ interface), and only ``bindings.cpp`` includes the
(few) torch headers it needs, which keeps the cold build short.

Environment:
    DIFFUSERS_FASTPATH_CACHE: the root of the build cache (default ``~/.cache/diffusers_fastpath``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from pathlib import Path

import torch

from .._logging import logger

EXTENSION_NAME = "diffusers_fastpath_C"
# --fmad=false: eager PyTorch rounds after every multiply and add; a contracted FMA would not. The kernels use
# __fmul_rn/__fadd_rn where it matters, and this flag keeps any other arithmetic honest too.
_CUDA_FLAGS = ("-O3", "--fmad=false", "-lineinfo")
_CXX_FLAGS = ("-O3",)

_lock = threading.Lock()
load_seconds: float | None = None  # wall time of the (cold or warm) load, for `report`
cold_build: bool | None = None


def csrc_dir() -> Path:
    """Where the CUDA sources live: inside the installed package (wheel) or beside it (source checkout)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "fastpath.h").is_file():
            return candidate
    raise FileNotFoundError(f"diffusers_fastpath: CUDA sources not found next to {package}")


def sources() -> list[Path]:
    """The translation units of the extension (headers are hashed too, see `_build_dir`)."""
    root = csrc_dir()
    return sorted(root.glob("*.cu")) + sorted(root.glob("*.cpp"))


def _arch_flags() -> tuple[str, list[str]]:
    """Machine code for the current GPU only (plain sm_XY: the kernels use no arch-specific 'a' features)."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    return arch, [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def _build_dir(arch: str) -> Path:
    digest = hashlib.sha256()
    root = csrc_dir()
    for path in sorted(root.iterdir()):
        if path.suffix in (".cu", ".cuh", ".cpp", ".h"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    for part in (torch.__version__, str(torch.version.cuda), arch, *_CUDA_FLAGS, *_CXX_FLAGS):
        digest.update(part.encode())
    cache = Path(os.environ.get("DIFFUSERS_FASTPATH_CACHE", Path.home() / ".cache" / "diffusers_fastpath"))
    return cache / f"{EXTENSION_NAME}_{digest.hexdigest()[:16]}"


@functools.cache
def load_extension() -> None:
    """Build (once per machine) and load the extension; registers the ``diffusers_fastpath::_*_cuda`` ops.

    Raises whatever the build raises (no nvcc, no ninja, a compiler error): the caller's fallback policy turns
    that into one warning and the eager path.
    """
    global load_seconds, cold_build
    from torch.utils.cpp_extension import load

    with _lock:
        start = time.perf_counter()
        arch, arch_flags = _arch_flags()
        build_dir = _build_dir(arch)
        build_dir.mkdir(parents=True, exist_ok=True)
        cold = not (build_dir / f"{EXTENSION_NAME}.so").exists()
        if cold:
            logger.warning(
                f"diffusers_fastpath: building the CUDA extension for sm_{arch} into {build_dir} "
                "(once per machine; this takes a minute)"
            )
        load(
            name=EXTENSION_NAME,
            sources=[str(p) for p in sources()],
            extra_cflags=list(_CXX_FLAGS),
            extra_cuda_cflags=[*_CUDA_FLAGS, *arch_flags],
            extra_include_paths=[str(csrc_dir())],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        load_seconds = time.perf_counter() - start
        cold_build = cold
        logger.info(f"diffusers_fastpath: CUDA extension {'built' if cold else 'loaded'} in {load_seconds:.1f} s")
