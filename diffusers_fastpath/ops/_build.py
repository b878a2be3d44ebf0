"""JIT build of the CUDA sources in ``csrc/`` into one torch extension.

The extension is built on the first CUDA call of any fused op with ``torch.utils.cpp_extension.load`` and ninja,
for the architecture of the GPU that is present only, and cached on disk in a directory named by a hash of the
sources, the build flags, the torch and CUDA versions and the GPU architecture: a changed kernel, another torch or
another GPU gets a fresh build, an unchanged one loads in well under a second. The kernels are compiled by nvcc
without torch's headers (``csrc/fastpath.h`` is the plain-C++ interface), and only ``bindings.cpp`` includes the
(few) torch headers it needs, which keeps the cold build short.

When no kernels can be had (a ROCm or CPU-only build of torch, no CUDA compiler, no ninja, a failed build), the
cause is found once, logged once as one warning that names it and the fix, and remembered: every later call raises
`KernelsUnavailable` at once (no second build attempt, no second warning), each op's fallback policy turns that into
its eager expression (the same numbers), and `diffusers_fastpath.report` says so in its first line
(`kernels_status`).

Environment:
    DIFFUSERS_FASTPATH_CACHE: the root of the build cache (default ``~/.cache/diffusers_fastpath``).
"""

from __future__ import annotations

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
unavailable: str | None = None  # why no kernels can be had in this process (set once, by the first attempt)
_EAGER = "every fused op runs its eager PyTorch expression (same numbers, no speedup)"


class KernelsUnavailable(RuntimeError):
    """No CUDA kernels in this process; the message says why and what would fix it. Raised by `load_extension`."""


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


def _toolkit_missing() -> str | None:
    """Why the extension cannot be built here (platform, compiler, ninja), or None; checked before any attempt."""
    if getattr(torch.version, "hip", None):
        return (f"this is a ROCm build of torch ({torch.version.hip}); the fused kernels are CUDA-only, so none is built. "
                f"{_EAGER}.")
    if torch.version.cuda is None:
        return f"this build of torch has no CUDA. {_EAGER}."
    from torch.utils import cpp_extension

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or cpp_extension._find_cuda_home()
    if not home or not (Path(home) / "bin" / "nvcc").is_file():
        return (
            f"no CUDA compiler found (nvcc: CUDA_HOME={home or 'unset'}, none on PATH), so the fused kernels cannot be "
            f"built; {_EAGER}. Fix: install a CUDA {torch.version.cuda} toolkit with nvcc (e.g. a -devel container, or "
            "conda install -c nvidia cuda-nvcc cuda-cudart-dev) and set CUDA_HOME to it; the kernels are then built "
            "once per machine."
        )
    if not cpp_extension.is_ninja_available():
        return f"ninja is not installed, so the fused kernels cannot be built; {_EAGER}. Fix: pip install ninja."
    return None


def _give_up(cause: str) -> KernelsUnavailable:
    global unavailable
    unavailable = cause
    logger.warning(f"diffusers_fastpath: {cause}")
    return KernelsUnavailable(cause)


def kernels_status() -> str:
    """One line: where this process's CUDA kernels come from, or why it has none (`report`'s first line)."""
    if unavailable is not None:
        return f"no CUDA kernels: {unavailable}"
    if load_seconds is not None:
        return f"CUDA kernels {'built' if cold_build else 'loaded'} in {load_seconds:.1f} s"
    return "CUDA kernels not loaded (they load on the first CUDA call of a fused op)"


def load_extension() -> None:
    """Build (once per machine) and load the extension; registers the ``diffusers_fastpath::_*_cuda`` ops.

    Raises:
        KernelsUnavailable: no kernels can be had in this process (the cause is logged once, on the first call;
            every later call raises at once, without another attempt). The caller's fallback policy turns that into
            the eager path.
    """
    if load_seconds is not None:
        return
    if unavailable is not None:
        raise KernelsUnavailable(unavailable)
    with _lock:
        if load_seconds is not None:
            return
        if unavailable is not None:
            raise KernelsUnavailable(unavailable)
        missing = _toolkit_missing()
        if missing is not None:
            raise _give_up(missing)
        try:
            _build_and_load()
        except Exception as exc:  # noqa: BLE001 - a failed build is reported once and remembered
            raise _give_up(f"the CUDA extension failed to build or load ({type(exc).__name__}: {exc}); {_EAGER}.") from exc


def _build_and_load() -> None:
    global load_seconds, cold_build
    from torch.utils.cpp_extension import load

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
    cold_build = cold
    load_seconds = time.perf_counter() - start
    logger.info(f"diffusers_fastpath: CUDA extension {'built' if cold else 'loaded'} in {load_seconds:.1f} s")
