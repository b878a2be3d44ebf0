"""The fused kernels without a CUDA toolkit: ``csrc/*.cu`` compiled at run time by NVRTC, launched with the driver API.

Every CUDA build of torch runs on a machine that has the CUDA driver (``libcuda``) and the NVRTC library (the
``nvidia-cuda-nvrtc`` wheel that CUDA wheels of torch depend on, or the toolkit's ``libnvrtc``); few have ``nvcc``.
This module is the second way `_build` gets the kernels, taken when no toolkit is there (docs/kernels.md says why
and what was measured):

- **Compile.** Each ``csrc/<op>.cu`` is one NVRTC program, compiled for the present GPU's architecture only
  (``--gpu-architecture=sm_XY``: machine code, no PTX, so the driver never JIT-compiles anything) with the device
  flags of the nvcc build (`_build.NVRTC_FLAGS`: ``--fmad=false``, line info, the half/bfloat16 defines
  ``torch.utils.cpp_extension`` gives nvcc). The sources guard their host launchers with
  ``#ifndef __CUDACC_RTC__``, so NVRTC sees exactly the kernels nvcc compiles; the template instantiations are named
  by NVRTC name expressions (``diffusers_fastpath::modulate_scale_shift_kernel<__nv_bfloat16>``), listed by each op
  file next to its launcher. ``tests/test_nvrtc.py`` checks on CPU that NVRTC's machine code of every kernel is
  byte-identical to nvcc's, which is what makes this path as exact as the other.
- **Cache.** The cubins go to ``$DIFFUSERS_FASTPATH_CACHE/nvrtc_<hash>/`` (default root ``~/.cache/diffusers_fastpath``,
  as `_build`), the hash over the sources and headers, the NVRTC version, the architecture, the flags and the
  fp16/bf16 headers used; a warm start reads them back without calling NVRTC.
- **Load and launch.** ``cuModuleLoadData`` / ``cuModuleGetFunction`` per device; `Kernel.launch` packs the
  arguments with one precompiled `struct.Struct` into a per-thread buffer and calls ``cuLaunchKernel`` with it
  (``CU_LAUNCH_PARAM_BUFFER_POINTER``) on the current torch stream. Each op file computes the launch shape and
  allocates the output exactly as ``csrc/bindings.cpp`` and the ``.cu`` launchers do (its ``_nvrtc_*`` function;
  the row kernels' grid is `row_grid` below, the Python twin of ``elementwise.cuh``'s).

Environment:
    DIFFUSERS_FASTPATH_NVRTC: path of the ``libnvrtc`` to use (default: the one torch's CUDA build loads, then the
        ``nvidia-cuda-nvrtc`` wheel's, then the toolkit's).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import os
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

from .._logging import logger

# --- the NVRTC library ------------------------------------------------------------------------------------------


def _cuda_major() -> int | None:
    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


def _wheel_dirs(kind: str) -> list[Path]:
    """``nvidia/cu13/<kind>`` (CUDA 13 wheels) and ``nvidia/cuda_nvrtc|cuda_runtime/<kind>`` (CUDA 12 wheels)."""
    found = []
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia"
        if root.is_dir():
            found += sorted(root.glob(f"cu[0-9]*/{kind}")) + sorted(root.glob(f"cuda_*/{kind}"))
    return found


def _nvrtc_candidates() -> list[str]:
    if os.environ.get("DIFFUSERS_FASTPATH_NVRTC"):
        return [os.environ["DIFFUSERS_FASTPATH_NVRTC"]]
    major = _cuda_major()
    if sys.platform == "win32":
        return [f"nvrtc64_{major}0_0.dll"] if major else []
    suffix = f".so.{major}" if major else ".so.*"
    names = [f"libnvrtc{suffix}"] if major else []  # the one a CUDA torch has already loaded, if it has
    for lib in _wheel_dirs("lib"):
        names += sorted(glob.glob(str(lib / f"libnvrtc{suffix}")))
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    names += sorted(glob.glob(str(Path(home) / "lib64" / f"libnvrtc{suffix}")))
    return names


_nvrtc_lib: ctypes.CDLL | None = None


def nvrtc_library() -> ctypes.CDLL:
    """The NVRTC library of this process (raises OSError naming what was tried when there is none)."""
    global _nvrtc_lib
    if _nvrtc_lib is not None:
        return _nvrtc_lib
    tried = _nvrtc_candidates()
    for name in tried:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        # libnvrtc dlopens libnvrtc-builtins by name at compile time; the wheel's 13.0 library has no RPATH, so load
        # the one beside it first (13.5 finds it through its $ORIGIN RPATH; preloading is harmless there).
        if os.path.sep in name:
            for builtins in sorted(glob.glob(str(Path(name).parent / "libnvrtc-builtins.so.*"))):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        for fn in ("nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetCUBIN", "nvrtcGetLoweredName"):
            getattr(lib, fn).restype = ctypes.c_int
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _nvrtc_lib = lib
        return lib
    raise OSError(f"no NVRTC library found (tried {', '.join(tried) or 'nothing: this torch has no CUDA'})")


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def supported_archs() -> list[int]:
    lib = nvrtc_library()
    count = ctypes.c_int()
    lib.nvrtcGetNumSupportedArchs(ctypes.byref(count))
    archs = (ctypes.c_int * count.value)()
    lib.nvrtcGetSupportedArchs(archs)
    return list(archs)


def _check(result: int, what: str, prog: ctypes.c_void_p | None = None) -> None:
    if result == 0:
        return
    message = f"{what}: {nvrtc_library().nvrtcGetErrorString(result).decode()}"
    if prog is not None:
        size = ctypes.c_size_t()
        nvrtc_library().nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc_library().nvrtcGetProgramLog(prog, log)
        message += "\n" + log.value.decode(errors="replace")[-4000:]
    raise RuntimeError(message)


# --- headers: cuda_fp16.h and cuda_bf16.h ---------------------------------------------------------------------


def _bundled_headers(cache: Path) -> Path | None:
    """NVRTC 13.1+ carries the toolkit's headers and can write them out (``nvrtcInstallBundledHeaders``)."""
    lib = nvrtc_library()
    if not hasattr(lib, "nvrtcInstallBundledHeaders"):
        return None
    major, minor = nvrtc_version()
    target = cache / f"nvrtc_headers_{major}.{minor}"
    log = ctypes.c_char_p()
    if lib.nvrtcInstallBundledHeaders(str(target).encode(), 0, ctypes.byref(log)) != 0:
        return None
    return target if (target / "cuda_fp16.h").is_file() else None


def include_dir(cache: Path) -> Path:
    """Where NVRTC finds cuda_fp16.h / cuda_bf16.h: its own bundled copy (same version as the compiler), else the
    CUDA runtime wheel's (a dependency of every CUDA wheel of torch), else a toolkit's."""
    bundled = _bundled_headers(cache)
    if bundled is not None:
        return bundled
    candidates = _wheel_dirs("include")
    for var in ("CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX"):
        if os.environ.get(var):
            root = Path(os.environ[var])
            candidates += [root / "include", root / "targets" / "x86_64-linux" / "include"]
    candidates.append(Path("/usr/local/cuda/include"))
    for candidate in candidates:
        if (candidate / "cuda_fp16.h").is_file() and (candidate / "cuda_bf16.h").is_file():
            return candidate
    raise OSError("cuda_fp16.h not found for NVRTC (no bundled headers, no nvidia-cuda-runtime wheel, no toolkit)")


# --- compile ------------------------------------------------------------------------------------------------------


def compile_cubin(
    source: Path, names: Sequence[str], arch: str, includes: Sequence[Path], flags: Sequence[str]
) -> tuple[bytes, dict[str, str]]:
    """NVRTC-compile one ``.cu`` file for ``sm_<arch>``; returns the cubin and each name expression's symbol."""
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None),
           f"nvrtcCreateProgram({source.name})")
    try:
        for name in names:
            _check(lib.nvrtcAddNameExpression(prog, name.encode()), f"nvrtcAddNameExpression({name})")
        options = [f"--gpu-architecture=sm_{arch}", *flags, *(f"-I{p}" for p in includes)]
        array = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        _check(lib.nvrtcCompileProgram(prog, len(options), array), f"NVRTC failed to compile {source.name}", prog)
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        lowered = {}
        for name in names:
            symbol = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(symbol)), f"nvrtcGetLoweredName({name})")
            lowered[name] = symbol.value.decode()
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# --- the driver ---------------------------------------------------------------------------------------------------

_CU_LAUNCH_PARAM_END, _CU_LAUNCH_PARAM_BUFFER_POINTER, _CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
_CUDA_ERROR_INVALID_CONTEXT = 201
_libcuda: ctypes.CDLL | None = None


def driver() -> ctypes.CDLL:
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p]
        lib.cuLaunchKernel.restype = ctypes.c_int
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        _libcuda = lib
    return _libcuda


def _check_cu(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{what}: CUDA driver error {result} ({(text.value or b'?').decode()})")


# --- launch shapes and kernel arguments ---------------------------------------------------------------------------

_num_sms: dict[int, int] = {}


def num_sms(device: int) -> int:
    """The device's SM count (what elementwise.cuh's num_sms reads with cudaDeviceGetAttribute), cached per device."""
    count = _num_sms.get(device)
    if count is None:
        count = _num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def grid_stride_blocks(device: int, vecs: int, threads: int, blocks_per_sm: int) -> int:
    """elementwise.cuh's grid_stride_blocks: a block of `threads` per as many vectors, at most `blocks_per_sm`
    resident blocks per SM."""
    return min((vecs + threads - 1) // threads, num_sms(device) * blocks_per_sm)


@functools.lru_cache(maxsize=4096)  # a model has a handful of shapes; a hit took 0.30 us against 0.57 us computed here
def row_grid(rows: int, vecs_per_row: int, threads: int, rows_in_flight: int, sms: int, blocks_per_sm: int = 8):
    """elementwise.cuh's row_grid, line for line: ((grid_x, grid_y, 1), (tx, ty, 1))."""
    tx = vecs_per_row if vecs_per_row < 128 else 128
    ty = threads // tx
    grid_x = (vecs_per_row + tx - 1) // tx
    rows_per_block = ty * rows_in_flight
    grid_y = (rows + rows_per_block - 1) // rows_per_block
    cap_y = (sms * blocks_per_sm + grid_x - 1) // grid_x
    grid_y = min(grid_y, cap_y, 65535)
    return (grid_x, grid_y, 1), (tx, ty, 1)


_CTYPES = {"P": ctypes.c_void_p, "q": ctypes.c_int64, "i": ctypes.c_int32, "f": ctypes.c_float, "?": ctypes.c_bool}


class Params:
    """A kernel's parameter list (or a struct of csrc/fastpath.h), laid out as the C ABI lays it out.

    ``fields`` are ``(name, code)`` with code one of ``P`` (pointer), ``q`` (int64_t), ``i`` (int32_t or an enum),
    ``f`` (float), ``?`` (bool), or another `Params` for a struct passed by value. The layout comes from a
    ``ctypes.Structure`` of the same fields (CUDA lays out kernel parameters and by-value structs as the host
    compiler does, each at its natural alignment), flattened into one `struct.Struct` with explicit padding that
    ends at the last field (`end`): ``pack_into`` writes every argument in one call, which is what keeps a launch's
    Python cost low (measured in `measure_host_cost`). These mirror csrc/fastpath.h by hand; tests/test_nvrtc.py checks them against the header
    compiled by the host compiler and against the parameter table (EIATTR_KPARAM_INFO) of the compiled kernels.
    """

    def __init__(self, name: str, *fields: tuple[str, "str | Params"]) -> None:
        self.name = name
        self.fields = fields
        self.ctype = type(name, (ctypes.Structure,), {
            "_fields_": [(f, p.ctype if isinstance(p, Params) else _CTYPES[p]) for f, p in fields]})
        self.size = ctypes.sizeof(self.ctype)
        leaves: list[tuple[int, str]] = []
        self._flatten(self, 0, leaves)
        fmt, pos = "=", 0  # '=': standard sizes, no automatic alignment; the padding is explicit
        for offset, code in leaves:
            code = "Q" if code == "P" else code  # a 64-bit device pointer ('P' has no standard size)
            fmt += f"{offset - pos}x" if offset > pos else ""
            fmt += code
            pos = offset + struct.calcsize("=" + code)
        # A kernel's parameter list ends at its last parameter: the driver rejects a buffer padded to the list's
        # alignment (cuLaunchKernel: "too many resources requested for launch"), so the packer stops at `end`.
        last = getattr(self.ctype, fields[-1][0])
        self.end = last.offset + last.size
        self.struct = struct.Struct(fmt + (f"{self.end - pos}x" if self.end > pos else ""))
        assert self.struct.size == self.end, (self.name, self.struct.format)

    @staticmethod
    def _flatten(params: "Params", base: int, out: list) -> None:
        for name, part in params.fields:
            offset = base + getattr(params.ctype, name).offset
            if isinstance(part, Params):
                Params._flatten(part, offset, out)
            else:
                out.append((offset, part))

    def offsets(self) -> dict[str, tuple[int, int]]:
        """Top-level field -> (offset, size), for the layout tests."""
        return {name: (getattr(self.ctype, name).offset, getattr(self.ctype, name).size) for name, _ in self.fields}


def check_out(op: str, out: torch.Tensor, shape, like: torch.Tensor, align: int, rows: bool = False) -> None:
    """An ``_out`` variant's output as bindings.cpp checks it: the shape, ``like``'s dtype and device, contiguous,
    ``align``-byte aligned (the kernels' vector width); with `rows`, a ``[B, S, D]`` output need only have aligned,
    non-overlapping rows of unit innermost stride (a kernel that takes the output's row strides)."""
    vec = align // out.element_size()
    if rows and out.dim() == 3:
        laid_out = (out.stride(2) == 1 and out.stride(1) % vec == 0 and out.stride(0) % vec == 0
                    and (out.shape[1] == 1 or out.stride(1) >= out.shape[2])
                    and (out.shape[0] == 1 or out.stride(0) >= out.shape[1] * out.stride(1)))
    else:
        laid_out = out.is_contiguous()
    if (tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device
            or not laid_out or out.data_ptr() % align):
        kind = "an aligned-rows" if rows else "a contiguous"
        raise ValueError(f"{op}: out must be {kind}, {align}-byte aligned {tuple(shape)} tensor of the input's "
                         f"dtype and device")


DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # csrc/fastpath.h's DType
STORAGE_TYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}


class Kernel:
    """One kernel template of one ``csrc/<source>``: its NVRTC name expressions by key and its parameters.

    Args:
        source: the ``.cu`` file name in ``csrc/``.
        template: the kernel's qualified name, e.g. ``"diffusers_fastpath::gated_residual_kernel"``.
        variants: key -> template arguments, e.g. ``{(torch.bfloat16, True): "__nv_bfloat16, true"}``.
        params: the kernel's parameter list.
    """

    def __init__(self, source: str, template: str, variants: dict, params: Params) -> None:
        self.source = source
        self.names = {key: f"{template}<{args}>" for key, args in variants.items()}
        self.params = params
        self.arg_bytes = params.end  # the parameter buffer's size: no tail padding after the last parameter
        self._pack_into = params.struct.pack_into
        self._functions: dict[int, dict] = {}  # device -> key -> CUfunction (an int)
        self._tls = threading.local()
        KERNELS.append(self)

    def _slot(self):
        """This thread's argument buffer and the ``extra`` array that points at it (cuLaunchKernel copies the
        arguments before it returns, so one buffer per thread is enough and two threads never share one)."""
        buf = ctypes.create_string_buffer(self.arg_bytes)
        size = ctypes.c_size_t(self.arg_bytes)
        extra = (ctypes.c_void_p * 5)(_CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buf),
                                      _CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), _CU_LAUNCH_PARAM_END)
        slot = self._tls.slot = (buf, extra, size)
        return slot

    def launch(self, device: int, key, grid, block, *args) -> None:
        """Launch variant ``key`` on ``device``'s current stream with ``args`` (flattened, in parameter order)."""
        functions = self._functions.get(device)
        if functions is None:
            functions = self._load(device)
        if torch._C._cuda_getDevice() != device:  # bindings.cpp's CUDAGuard: launch in the tensors' device context
            with torch.cuda.device(device):
                return self.launch(device, key, grid, block, *args)
        try:
            buf, extra, _ = self._tls.slot
        except AttributeError:
            buf, extra, _ = self._slot()
        self._pack_into(buf, 0, *args)
        stream = torch._C._cuda_getCurrentRawStream(device)
        err = _launch(functions[key], grid[0], grid[1], grid[2], block[0], block[1], block[2], 0, stream, None, extra)
        if err:
            self._launch_failed(err, device, functions[key], grid, block, stream, extra)

    def _launch_failed(self, err, device, function, grid, block, stream, extra) -> None:
        if err == _CUDA_ERROR_INVALID_CONTEXT:  # a thread where the runtime has not made the context current yet
            _check_cu(driver().cuCtxSetCurrent(_contexts[device]), "cuCtxSetCurrent")
            err = _launch(function, *grid, *block, 0, stream, None, extra)
        _check_cu(err, f"cuLaunchKernel({self.names})")

    def _load(self, device: int) -> dict:
        with _lock:
            if device not in self._functions:
                module = load_module(self.source, device)
                functions = {}
                for key, name in self.names.items():
                    fn = ctypes.c_void_p()
                    symbol = module_symbols[self.source][name].encode()
                    _check_cu(driver().cuModuleGetFunction(ctypes.byref(fn), module, symbol), f"cuModuleGetFunction({name})")
                    functions[key] = fn.value
                self._functions[device] = functions
        return self._functions[device]


def _launch(*args) -> int:
    return driver().cuLaunchKernel(*args)


KERNELS: list[Kernel] = []  # every kernel the op files declare, in import order
module_symbols: dict[str, dict[str, str]] = {}  # source -> name expression -> symbol in its cubin
_cubins: dict[str, bytes] = {}
_modules: dict[tuple[str, int], int] = {}
_contexts: dict[int, int] = {}
_lock = threading.RLock()
compile_seconds: float | None = None
cold_compile: bool | None = None
cache_dir: Path | None = None


def load_module(source: str, device: int) -> int:
    """The loaded CUmodule of ``source`` on ``device`` (loads the cubin into that device's primary context)."""
    key = (source, device)
    with _lock:
        if key not in _modules:
            with torch.cuda.device(device):
                torch.cuda.init()
                torch.empty(0, device=f"cuda:{device}")  # the runtime makes the primary context current here
                ctx = ctypes.c_void_p()
                _check_cu(driver().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
                _contexts[device] = ctx.value
                module = ctypes.c_void_p()
                loaded = driver().cuModuleLoadData(ctypes.byref(module), _cubins[source])
                _check_cu(loaded, f"cuModuleLoadData({source})")
                _modules[key] = module.value
    return _modules[key]


def _sources() -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for kernel in KERNELS:
        names.setdefault(kernel.source, []).extend(kernel.names.values())
    return names


def _digest(csrc: Path, includes: Path, arch: str, flags: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    for header in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"):
        if (includes / header).is_file():
            digest.update((includes / header).read_bytes())
    for name, expressions in sorted(_sources().items()):
        digest.update(name.encode() + "\0".join(expressions).encode())
    for part in ("%d.%d" % nvrtc_version(), arch, *flags):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def build(csrc: Path, cache_root: Path, arch: str, flags: Sequence[str]) -> bool:
    """Compile (or read from the cache) every declared kernel's source for ``sm_<arch>``; True if it compiled.

    The sources compile in parallel threads (NVRTC programs are independent): on this CPU machine the six take
    about as long as the slowest one.
    """
    global compile_seconds, cold_compile, cache_dir
    start = time.perf_counter()
    cache_root.mkdir(parents=True, exist_ok=True)
    includes = include_dir(cache_root)
    cache_dir = cache_root / f"nvrtc_{_digest(csrc, includes, arch, flags)}"
    sources = _sources()
    missing = [s for s in sources if not ((cache_dir / f"{s}.cubin").is_file() and (cache_dir / f"{s}.json").is_file())]
    if missing:
        logger.warning(f"diffusers_fastpath: compiling the CUDA kernels with NVRTC {'%d.%d' % nvrtc_version()} for "
                       f"sm_{arch} into {cache_dir} (once per machine)")
        cache_dir.mkdir(parents=True, exist_ok=True)

        def one(source: str) -> None:
            cubin, lowered = compile_cubin(csrc / source, sources[source], arch, [csrc, includes], flags)
            for suffix, data in ((".cubin", cubin), (".json", json.dumps(lowered, indent=1).encode())):
                tmp = cache_dir / f"{source}{suffix}.{os.getpid()}.{threading.get_ident()}.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, cache_dir / f"{source}{suffix}")  # atomic: a reader never sees half a file

        with ThreadPoolExecutor(max_workers=len(missing)) as pool:
            list(pool.map(one, missing))
    for source in sources:
        _cubins[source] = (cache_dir / f"{source}.cubin").read_bytes()
        module_symbols[source] = json.loads((cache_dir / f"{source}.json").read_text())
    cold_compile = bool(missing)
    compile_seconds = time.perf_counter() - start
    return cold_compile


# --- the raw ops on the NVRTC way -----------------------------------------------------------------------------------

RAW_OPS: list[tuple[str, str, object]] = []  # (name, schema after the name, implementation), from the op files
_raw_library = None


def raw_op(name: str, schema: str, guard, fn, outs: int = 0) -> None:
    """Declare ``diffusers_fastpath::<name>`` (bindings.cpp's schema) for the NVRTC way.

    Direct calls of these ops bypass the fused op's policy, so the op's own guard runs first and inputs it refuses
    raise instead of reaching the kernel, as bindings.cpp's checks make them. ``outs`` > 0: an ``_out`` variant
    whose first ``outs`` arguments are written; ``fn(*inputs, out=...)`` then gets them (one tensor or a tuple).
    """

    def checked(*args):
        inputs = args[outs:]
        reason = guard(*inputs)
        if reason is not None:
            raise ValueError(f"diffusers_fastpath::{name}: the kernel does not take these inputs ({reason})")
        if not outs:
            return fn(*inputs)
        fn(*inputs, out=args[0] if outs == 1 else args[:outs])
        return None

    RAW_OPS.append((name, schema, checked))


def define_raw_ops() -> None:
    """Register the ``_*_cuda`` ops over the launchers, unless the nvcc extension already defined them."""
    global _raw_library
    if _raw_library is not None:
        return
    try:
        torch.ops.diffusers_fastpath._modulate_scale_shift_cuda.default  # noqa: B018 - defined by the extension?
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("diffusers_fastpath", "FRAGMENT")
    for name, schema, fn in RAW_OPS:
        lib.define(name + schema)
        lib.impl(name, fn, "CUDA")
    _raw_library = lib


def measure_host_cost(kernel: Kernel, args: Sequence, number: int = 20000) -> dict[str, float]:
    """Microseconds per call of the Python parts of one launch that need no GPU: the argument packing alone, and
    packing plus this thread's buffer lookup (what `Kernel.launch` does before ``cuLaunchKernel``).

    On a GPU machine the bench's kernel level should time a whole ``op._kernel(...)`` call on both paths instead.
    """
    import timeit

    buf, extra, _ = kernel._slot()
    pack = kernel._pack_into
    tls = kernel._tls

    def packed():
        pack(buf, 0, *args)

    def slot_and_pack():
        b = tls.slot[0]
        pack(b, 0, *args)

    def percall_ctypes():  # the alternative: a fresh ctypes.Structure and pointer array per call
        s = kernel.params.ctype(*args[: len(kernel.params.fields)])
        (ctypes.c_void_p * 1)(ctypes.addressof(s))

    return {name: min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6
            for name, fn in (("pack", packed), ("slot+pack", slot_and_pack), ("ctypes struct", percall_ctypes))}

