"""The CUDA kernels of ``csrc/``, two ways: a JIT-built torch extension (nvcc) or NVRTC (no toolkit needed).

Which way (`backend`): with a CUDA toolkit (nvcc and ninja) the extension below, as before; without one, NVRTC
(`_nvrtc`: the NVRTC library that CUDA builds of torch install, the driver API to load and launch), which compiles
the same ``.cu`` files with the same device flags; ``tests/test_nvrtc.py`` shows the two give byte-identical machine
code for every kernel (docs/kernels.md). ``DIFFUSERS_FASTPATH_KERNELS=nvcc`` or ``=nvrtc`` forces one. Each op's
``_kernel`` calls its `LazyLauncher`, which asks `load_extension` once which way it got and then calls the extension's
``torch.ops.diffusers_fastpath._*_cuda`` op or the op's own NVRTC launcher. On the NVRTC way the same ``_*_cuda`` ops
are registered too (Python implementations over the launchers), so tests, examples and the bench call one name on both.

The nvcc way:

The extension is built on the first CUDA call of any fused op with ``torch.utils.cpp_extension.load`` and ninja,
for the architecture of the GPU that is present only, and cached on disk in a directory named by a hash of the
sources, the build flags, the torch and CUDA versions and the GPU architecture: a changed kernel, another torch or
another GPU gets a fresh build, an unchanged one loads in well under a second. The kernels are compiled by nvcc
without torch's headers (``csrc/fastpath.h`` is the plain-C++ interface), and only the ``bindings*.cpp`` files
(one per family of ops, through ``bindings_common.h``) include the (few) torch headers they need, which keeps the
cold build short.

When no kernels can be had (a ROCm or CPU-only build of torch, no CUDA compiler, no ninja, a failed build), the
cause is found once, logged once as one warning that names it and the fix, and remembered: every later call raises
`KernelsUnavailable` at once (no second build attempt, no second warning), each op's fallback policy turns that into
its eager expression (the same numbers), and `diffusers_fastpath.report` says so in its first line
(`kernels_status`).

Environment:
    DIFFUSERS_FASTPATH_CACHE: the root of the build cache (default ``~/.cache/diffusers_fastpath``), both ways.
    DIFFUSERS_FASTPATH_KERNELS: ``nvcc`` or ``nvrtc`` to take only that way (default: nvcc if a toolkit is there,
        else NVRTC).
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
# What torch.utils.cpp_extension adds to every nvcc command (COMMON_NVCC_FLAGS' defines): NVRTC gets them too, so that
# cuda_fp16.h / cuda_bf16.h expand the same way under both compilers.
KERNEL_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
)
# The NVRTC flags of the nvcc build's device code: nvcc's -O3 is the host compiler's level (device code gets ptxas'
# default -O3 under both; NVRTC rejects -O3), --expt-relaxed-constexpr is not an NVRTC option and no kernel needs it.
NVRTC_FLAGS = ("--fmad=false", "-lineinfo", "-std=c++17", *KERNEL_DEFINES)
ENV_KERNELS = "DIFFUSERS_FASTPATH_KERNELS"
BACKENDS = ("nvcc", "nvrtc")

_lock = threading.Lock()
load_seconds: float | None = None  # wall time of the (cold or warm) load, for `report`
cold_build: bool | None = None
backend: str | None = None  # "nvcc" or "nvrtc": the way this process got its kernels
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
    return cache_root() / f"{EXTENSION_NAME}_{digest.hexdigest()[:16]}"


def cache_root() -> Path:
    return Path(os.environ.get("DIFFUSERS_FASTPATH_CACHE", Path.home() / ".cache" / "diffusers_fastpath"))


def _platform_missing() -> str | None:
    """Why no way can give CUDA kernels in this build of torch, or None."""
    if getattr(torch.version, "hip", None):
        return (f"this is a ROCm build of torch ({torch.version.hip}); the fused kernels are CUDA-only, so none is built. "
                f"{_EAGER}.")
    if torch.version.cuda is None:
        return f"this build of torch has no CUDA. {_EAGER}."
    return None


def _toolkit_missing() -> str | None:
    """Why the extension cannot be built here (compiler, ninja), or None; checked before any attempt, after
    `_platform_missing` (`load_extension` asks that first, for both ways)."""
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


def _nvrtc_missing() -> str | None:
    """Why NVRTC cannot give the kernels here (no library, no headers, no driver, no GPU, an arch it does not know),
    or None; checked before any compilation, without logging."""
    from . import _nvrtc

    try:
        _nvrtc.nvrtc_library()
        _nvrtc.include_dir(cache_root())
    except OSError as exc:
        return str(exc)
    try:
        _nvrtc.driver()
    except OSError as exc:
        return f"no CUDA driver ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability()
    if major * 10 + minor not in _nvrtc.supported_archs():
        return f"NVRTC {'%d.%d' % _nvrtc.nvrtc_version()} cannot compile for this GPU (sm_{major}{minor})"
    return None


def _nvrtc_fix() -> str:
    return (f"NVRTC, the way that needs no toolkit, is not usable either: {{}}. It needs the NVRTC library of CUDA "
            f"{torch.version.cuda} (pip install nvidia-cuda-nvrtc, which CUDA builds of torch install) and a CUDA GPU "
            "with its driver.")


def kernels_status() -> str:
    """One line: where this process's CUDA kernels come from, or why it has none (`report`'s first line)."""
    if unavailable is not None:
        return f"no CUDA kernels: {unavailable}"
    if load_seconds is not None:
        how = ("compiled with NVRTC" if cold_build else "loaded (NVRTC cache)") if backend == "nvrtc" else (
            "built" if cold_build else "loaded")
        return f"CUDA kernels {how} in {load_seconds:.1f} s"
    return "CUDA kernels not loaded (they load on the first CUDA call of a fused op)"


def load_extension() -> str:
    """Get the kernels once per process, the first way that works; returns it (``"nvcc"`` or ``"nvrtc"``).

    nvcc: build (once per machine) and load the extension, which registers the ``diffusers_fastpath::_*_cuda`` ops.
    NVRTC: compile (once per machine) and load the cubins, and register the same ops over the Python launchers.

    Raises:
        KernelsUnavailable: no kernels can be had in this process (the cause of each way is logged once, in one
            warning, on the first call; every later call raises at once, without another attempt). The caller's
            fallback policy turns that into the eager path.
    """
    if load_seconds is not None:
        return backend
    if unavailable is not None:
        raise KernelsUnavailable(unavailable)
    with _lock:
        if load_seconds is not None:
            return backend
        if unavailable is not None:
            raise KernelsUnavailable(unavailable)
        platform = _platform_missing()
        if platform is not None:
            raise _give_up(platform)
        forced = os.environ.get(ENV_KERNELS, "").strip().lower()
        if forced and forced not in BACKENDS:
            raise _give_up(f"{ENV_KERNELS}={forced!r} names no way to get kernels (nvcc or nvrtc); {_EAGER}.")
        causes, failed_build = [], None
        if forced in ("", "nvcc"):
            missing = _toolkit_missing()
            if missing is None:
                try:
                    _build_and_load()
                    return backend
                except Exception as exc:  # noqa: BLE001 - a failed build is reported once and remembered
                    missing = failed_build = (f"the CUDA extension failed to build or load ({type(exc).__name__}: "
                                              f"{exc}); {_EAGER}.")
            causes.append(missing)
        if forced in ("", "nvrtc"):
            missing = _nvrtc_missing()
            if missing is None:
                try:
                    _compile_and_load_nvrtc()
                    if failed_build:  # a toolkit is there but its build failed: say so once; the kernels still run
                        logger.warning(f"diffusers_fastpath: {failed_build.split('; ')[0]}. Using the NVRTC kernels "
                                       "instead (same code, see docs/kernels.md).")
                    return backend
                except Exception as exc:  # noqa: BLE001 - reported once and remembered, like a failed build
                    missing = f"NVRTC failed to compile or load the kernels ({type(exc).__name__}: {exc})"
            causes.append(_nvrtc_fix().format(missing) if causes else f"{missing}; {_EAGER}.")
        raise _give_up(" ".join(causes))


def launcher(nvrtc_fn, raw_op: str):
    """What an op's fast path launches its kernel through, decided on its first use (which loads the kernels, see
    `load_extension`): `nvrtc_fn`, the op's ops/_nvrtc.py launcher, on the NVRTC way; else the nvcc extension's
    ``torch.ops.diffusers_fastpath.<raw_op>`` (a direct C++ call). The op's `LazyLauncher` keeps the result for later
    calls."""
    return nvrtc_fn if load_extension() == "nvrtc" else getattr(torch.ops.diffusers_fastpath, raw_op).default


class LazyLauncher:
    """An op's kernel entry point, a module global: `launcher` resolved on the first call, called directly after."""

    __slots__ = ("_nvrtc_fn", "_raw_op", "_fn")

    def __init__(self, nvrtc_fn, raw_op: str) -> None:
        self._nvrtc_fn, self._raw_op, self._fn = nvrtc_fn, raw_op, None

    def __call__(self, *args):
        fn = self._fn
        if fn is None:  # the first call (each call while `launcher` raises: no kernels, nothing kept)
            fn = self._fn = launcher(self._nvrtc_fn, self._raw_op)
        return fn(*args)


def _compile_and_load_nvrtc() -> None:
    global load_seconds, cold_build, backend
    from . import _nvrtc

    start = time.perf_counter()
    major, minor = torch.cuda.get_device_capability()
    cold = _nvrtc.build(csrc_dir(), cache_root(), f"{major}{minor}", NVRTC_FLAGS)
    # the cubins load into each device's context on that device's first launch (`_nvrtc.load_module`)
    _nvrtc.define_raw_ops()
    cold_build, backend = cold, "nvrtc"
    load_seconds = time.perf_counter() - start
    logger.info(f"diffusers_fastpath: NVRTC kernels {'compiled' if cold else 'loaded'} in {load_seconds:.1f} s")


def _build_and_load() -> None:
    global load_seconds, cold_build, backend
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
    cold_build, backend = cold, "nvcc"
    load_seconds = time.perf_counter() - start
    logger.info(f"diffusers_fastpath: CUDA extension {'built' if cold else 'loaded'} in {load_seconds:.1f} s")
