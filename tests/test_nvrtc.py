"""The NVRTC way to the kernels (ops/_nvrtc.py): as exact as the nvcc build, chosen only when it should be.

On CPU (each test skips without what it needs: nvcc, libnvrtc, cuobjdump, a host compiler):
- NVRTC's machine code of every kernel equals nvcc's byte for byte when the two compilers are one CUDA release
  (another release may allocate registers otherwise: skipped, with the pip line that makes them one);
- the Python launchers pass what the kernels take: parameter tables of the compiled kernels, struct layouts of
  csrc/fastpath.h as the host compiler lays them out, the launch constants of the .cu files, elementwise.cuh's
  row_grid, bindings.cpp's op schemas;
- the way is chosen as documented (toolkit: nvcc; none but NVRTC: NVRTC; neither: one warning).
On a GPU (marked): every op through NVRTC is torch.equal to the nvcc build and to eager at FLUX shapes; first use
cold and warm; host time per call of both ways.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusers_fastpath.ops import _build, _nvrtc  # importing ops runs the op files, which declare their kernels
# the op modules themselves (ops/__init__ binds each module's name to its public function)
gated_residual_mod = importlib.import_module("diffusers_fastpath.ops.gated_residual")
gelu_cat_mod = importlib.import_module("diffusers_fastpath.ops.gelu_cat")
silu_mul_mod = importlib.import_module("diffusers_fastpath.ops.silu_mul")
sigmoid_mul_mod = importlib.import_module("diffusers_fastpath.ops.sigmoid_mul")
cat_heads_mod = importlib.import_module("diffusers_fastpath.ops.cat_heads")
layernorm_mod = importlib.import_module("diffusers_fastpath.ops.layernorm_scale_shift")
layernorm_modulate_mod = importlib.import_module("diffusers_fastpath.ops.layernorm_modulate")
modulate_mod = importlib.import_module("diffusers_fastpath.ops.modulate_scale_shift")
qk_mod = importlib.import_module("diffusers_fastpath.ops.qk_norm_rope")
rmsnorm_mod = importlib.import_module("diffusers_fastpath.ops.rmsnorm_scale_shift")
rmsnorm_plain_mod = importlib.import_module("diffusers_fastpath.ops.rmsnorm")
rmsnorm_modulate_mod = importlib.import_module("diffusers_fastpath.ops.rmsnorm_modulate")
rotary_mod = importlib.import_module("diffusers_fastpath.ops.rotary")

CSRC = _build.csrc_dir()
CUDA_HOME = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
NVCC = str(CUDA_HOME / "bin" / "nvcc") if (CUDA_HOME / "bin" / "nvcc").exists() else shutil.which("nvcc")


def _cuda_tool(name: str) -> str | None:
    """A CUDA binary tool: on PATH, a toolkit's, or a wheel's (nvidia-cuda-<name>, beside the libraries' wheels)."""
    found = shutil.which(name)
    for candidate in [CUDA_HOME / "bin" / name, *(d.parent / "bin" / name for d in _nvrtc._wheel_dirs("lib"))]:
        if found is None and candidate.exists():
            found = str(candidate)
    return found


def _nvrtc_or_none():
    try:
        _nvrtc.nvrtc_library()
        return _nvrtc.nvrtc_version()
    except OSError:
        return None


CUOBJDUMP = _cuda_tool("cuobjdump")
NVDISASM = _cuda_tool("nvdisasm")  # (which cuobjdump -sass runs)
NVRTC_VERSION = _nvrtc_or_none()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc")
needs_nvrtc = pytest.mark.skipif(NVRTC_VERSION is None, reason="no libnvrtc (pip install nvidia-cuda-nvrtc)")
needs_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (pip install nvidia-cuda-cuobjdump)")
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason="no nvdisasm (pip install nvidia-cuda-nvdisasm)")
SOURCES = sorted({k.source for k in _nvrtc.KERNELS})


# --- cubin reading (ELF64 sections; no nvdisasm needed, which no wheel ships) -------------------------------------


def _sections(path: Path) -> dict[str, bytes]:
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{path} is not an ELF64 cubin"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    out = {}
    for name, kind, _, _, offset, size, *_ in headers:
        start = names + name
        out[data[start:data.index(b"\0", start)].decode()] = b"" if kind == 8 else data[offset:offset + size]  # 8: NOBITS
    return out


def _normal(symbol: str) -> str:
    """The symbol without its anonymous-namespace part, which nvcc and NVRTC name after the file and a hash."""
    m = re.search(r"(\d+)_GLOBAL__N_", symbol)
    if m is None:
        return symbol
    end = m.end(1) + int(m.group(1))
    return symbol[:m.start(1)] + "(anonymous)" + symbol[end:]


def _kernels(path: Path) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for name, data in _sections(path).items():
        for prefix in (".text.", ".nv.info."):
            if name.startswith(prefix):
                out.setdefault(_normal(name[len(prefix):]), {})[prefix] = data
    return out


def _nv_info(data: bytes) -> list[tuple[int, bytes]]:
    """The EIATTR records of a kernel's .nv.info section as (attribute, value)."""
    out, i = [], 0
    while i < len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == 4:  # EIFMT_SVAL: a u16 size, then the value
            (size,) = struct.unpack_from("<H", data, i + 2)
            out.append((attr, data[i + 4:i + 4 + size]))
            i += 4 + size
        else:  # EIFMT_NVAL / BVAL / HVAL: the value fits in the record
            out.append((attr, data[i + 2:i + 4] if fmt != 1 else b""))
            i += 2 if fmt == 1 else 4
    return out


EIATTR_KPARAM_INFO, EIATTR_PARAM_CBANK = 0x17, 0x0A
_CONTROL_BITS = 105  # sm_70+ instructions: 128 bits, of which bits 105..127 are scheduling control (stall, yield,
# barriers, operand reuse); the opcode, registers, immediates and modifiers are in bits 0..104


def _instructions(text: bytes) -> list[int]:
    mask = (1 << _CONTROL_BITS) - 1
    return [int.from_bytes(text[i:i + 16], "little") & mask for i in range(0, len(text), 16)]


def _param_table(info: bytes) -> dict[int, tuple[int, int]]:
    """EIATTR_KPARAM_INFO: ordinal -> (offset, size) of each kernel parameter, as the compiler laid them out."""
    table = {}
    for attr, value in _nv_info(info):
        if attr == EIATTR_KPARAM_INFO:
            _, ordinal, offset, flags = struct.unpack("<IHHI", value)
            table[ordinal] = (offset, (flags >> 18) & 0x3FFF)
    return table


def _comparable_info(info: bytes) -> list[tuple[int, bytes]]:
    # PARAM_CBANK's first word is the symbol-table index of the constant bank section, which differs by symbol order
    return [(a, v[4:] if a == EIATTR_PARAM_CBANK else v) for a, v in _nv_info(info)]


def _nvcc_cubin(source: str, out: Path) -> Path:
    cubin = out / f"{source}.cubin"
    cmd = [NVCC, "-cubin", "-o", str(cubin), str(CSRC / source), "-std=c++17", "-gencode=arch=compute_90,code=sm_90",
           *_build._CUDA_FLAGS, f"-I{CSRC}", *_build.KERNEL_DEFINES, "--expt-relaxed-constexpr"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return cubin


def _nvcc_version() -> tuple[int, int]:
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", out).groups()
    return int(major), int(minor)


def _resources(cubin: Path) -> dict[str, str]:
    """cuobjdump -res-usage: registers, stack, shared, local and constant memory per kernel."""
    out = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    return {_normal(m.group(1)): m.group(2).strip() for m in re.finditer(r"Function (\S+):\n\s*(REG:.*)", out)}


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    """Every kernel source compiled for sm_90 by nvcc (the build's flags) and by NVRTC (ops/_nvrtc.py's build)."""
    if NVCC is None or NVRTC_VERSION is None:
        pytest.skip("needs nvcc and libnvrtc")
    root = tmp_path_factory.mktemp("cubins")
    (root / "nvcc").mkdir()
    nvcc = {s: _nvcc_cubin(s, root / "nvcc") for s in SOURCES}
    _nvrtc.build(CSRC, root / "cache", "90", _build.NVRTC_FLAGS)
    nvrtc = {s: _nvrtc.cache_dir / f"{s}.cubin" for s in SOURCES}
    return nvcc, nvrtc


# --- CPU: the machine code ----------------------------------------------------------------------------------------


@needs_nvcc
@needs_nvrtc
@pytest.mark.parametrize("source", SOURCES)
def test_nvrtc_machine_code_equals_nvcc(source, cubins):
    nvcc, nvrtc = (_kernels(c[source]) for c in cubins)
    declared = {k for kernel in _nvrtc.KERNELS if kernel.source == source
                for k in map(_normal, (_nvrtc.module_symbols[source][n] for n in kernel.names.values()))}
    assert set(nvrtc) == set(nvcc) == declared  # the same instantiations, and every one the launchers name
    _skip_unless_one_release()
    for name in nvcc:  # one release: the whole kernel, scheduling bits and metadata too
        a, b = nvcc[name][".text."], nvrtc[name][".text."]
        assert len(a) == len(b) and _instructions(a) == _instructions(b), f"{name}: NVRTC {NVRTC_VERSION} emits other code"
        assert a == b, name
        assert _comparable_info(nvcc[name][".nv.info."]) == _comparable_info(nvrtc[name][".nv.info."]), name


def _skip_unless_one_release() -> None:
    """The machine code is held to nvcc's only where the two compilers are one CUDA release. Across releases it may
    differ: NVRTC 13.5.37 against nvcc 13.0.88 (at ed203a0) allocated the LayerNorm kernels' registers differently
    (bf16 with 12 vectors a thread: 30208 bytes of code against 32000) though the other sources matched instruction
    for instruction. The test extra takes any CUDA 13 NVRTC (torch's own pin decides which); .ci/run installs the one
    of nvcc's release and runs this file again."""
    nvcc = _nvcc_version()
    if NVRTC_VERSION != nvcc:
        pytest.skip(f"NVRTC {'%d.%d' % NVRTC_VERSION} and nvcc {'%d.%d' % nvcc} are different CUDA releases, whose "
                    f"machine code may differ; pip install 'nvidia-cuda-nvrtc=={'%d.%d' % nvcc}.*' to compare them")


@needs_nvcc
@needs_nvrtc
@needs_cuobjdump
def test_nvrtc_kernels_use_the_resources_of_nvcc_kernels(cubins):
    _skip_unless_one_release()
    nvcc, nvrtc = cubins
    for source in SOURCES:
        a, b = _resources(nvcc[source]), _resources(nvrtc[source])
        assert a and a == b, source


# The kernels whose every global store is a whole 16-byte vector (elementwise.cuh's store_pack / store_words), by
# source: name fragments of their (mangled) symbols. nvcc kept a Pack filled value by value in separate registers and
# stored it in 2-, 4- and 8-byte pieces (seven stores a lane at Wan's channel norm, two thirds of its L2 sectors).
WHOLE_VECTOR_STORES = {
    "causal_pad.cu": ("causal_pad_cl_wide_kernel", "channel_rmsnorm_pad_cl_wide_kernel", "ltx_rmsnorm_pad_cl_wide_kernel"),
    "conv_bias.cu": ("bias_contiguous_wide_kernel",),
    "group_norm_silu.cu": ("group_norm_apply_cl_kernel",),
    "silu_mul.cu": ("silu_mul_kernel", "sigmoid_mul_kernel"),
    "ltx_vae_rmsnorm.cu": ("ltx_rmsnorm_kernel",),
    "per_channel_rmsnorm.cu": ("per_channel_rmsnorm_kernelI13__nv_bfloat16Lb1E", "per_channel_rmsnorm_kernelI6__halfLb1E"),
}


def _global_stores(cubin: Path) -> dict[str, set[str]]:
    """Each kernel's global store opcodes (``STG.E``, ``STG.E.128``, ...) from cuobjdump -sass (which runs nvdisasm:
    NVDISASM_PATH names the one found)."""
    env = {**os.environ, "NVDISASM_PATH": str(Path(NVDISASM).parent)}
    out = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], capture_output=True, text=True, check=True, env=env).stdout
    stores: dict[str, set[str]] = {}
    name = None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            stores[name] = set()
        elif name and (m := re.search(r"\b(STG(?:\.[A-Z0-9]+)*)\s", line)):
            stores[name].add(m.group(1))
    return stores


@needs_nvcc
@needs_nvrtc
@needs_cuobjdump
@needs_nvdisasm
@pytest.mark.parametrize("source", sorted(WHOLE_VECTOR_STORES))
def test_vector_kernels_store_whole_16_byte_vectors(source, cubins):
    for cubin in (c[source] for c in cubins):
        stores = _global_stores(cubin)
        for fragment in WHOLE_VECTOR_STORES[source]:
            found = {name: ops for name, ops in stores.items() if fragment in name}
            assert found, f"{source}: no kernel named like {fragment}"
            for name, ops in found.items():
                assert ops == {"STG.E.128"}, f"{name}: {sorted(ops)}"


# --- CPU: what the launchers pass ---------------------------------------------------------------------------------


@needs_nvcc
@needs_nvrtc
def test_launchers_pack_the_parameter_tables_of_the_kernels(cubins):
    _, nvrtc = cubins
    for kernel in _nvrtc.KERNELS:
        kernels = _kernels(nvrtc[kernel.source])
        expected = {i: v for i, v in enumerate(kernel.params.offsets().values())}
        for name in kernel.names.values():
            info = kernels[_normal(_nvrtc.module_symbols[kernel.source][name])][".nv.info."]
            table = _param_table(info)
            assert table == expected, name
            assert kernel.arg_bytes == max(off + size for off, size in table.values()), name  # the param space


def _all_params() -> dict[str, _nvrtc.Params]:
    found: dict[str, _nvrtc.Params] = {}

    def walk(p: _nvrtc.Params) -> None:
        for _, part in p.fields:
            if isinstance(part, _nvrtc.Params):
                found[part.name] = part
                walk(part)

    for kernel in _nvrtc.KERNELS:
        walk(kernel.params)
    return found


def test_param_structs_match_fastpath_h(tmp_path):
    """The Python mirrors of csrc/fastpath.h's structs have its fields in its order at its offsets (host compiler)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    structs = _all_params()
    assert {"GeluCatArgs", "LayerNormScaleShiftArgs", "Rows", "RmsNormScaleShiftArgs", "RotarySource", "RotaryArgs"} <= set(structs)
    lines = ['#include <cstddef>', '#include <cstdio>', '#include "fastpath.h"', "using namespace diffusers_fastpath;",
             "int main() {", 'std::printf("{");']
    for name, p in structs.items():
        lines.append(f'std::printf("\\"{name}\\": [%zu", sizeof({name}));')
        for field, _ in p.fields:
            lines.append(f'std::printf(", [\\"{field}\\", %zu, %zu]", offsetof({name}, {field}), sizeof((({name}*)0)->{field}));')
        lines.append('std::printf("], ");')
    lines += ['std::printf("\\"end\\": 0}");', "}"]
    (tmp_path / "layout.cpp").write_text("\n".join(lines))
    # -D__CUDACC_RTC__: the header's device-side view (no <cuda_runtime.h>); the structs are the same in both views
    proc = subprocess.run([cxx, "-std=c++17", "-D__CUDACC_RTC__", f"-I{CSRC}", str(tmp_path / "layout.cpp"), "-o",
                           str(tmp_path / "layout")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    layout = json.loads(subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout)
    for name, p in structs.items():
        size, *fields = layout[name]
        assert size == p.size, name
        assert [(f, off, sz) for f, off, sz in fields] == [(f, *p.offsets()[f]) for f, _ in p.fields], name


def test_launch_buffers_end_at_the_last_parameter():
    """cuLaunchKernel refuses a parameter buffer longer than the kernel's parameter space ("too many resources
    requested for launch", CUDA error 701, seen on the H200 without a toolkit): silu_mul's list, a 104-byte struct and
    an int, is 108 bytes, not the 112 of the ctypes.Structure that lays it out."""
    sizes = {k.params.name: (k.arg_bytes, k.params.size) for k in _nvrtc.KERNELS}
    assert sizes["silu_mul_kernel"] == (108, 112)
    for kernel in _nvrtc.KERNELS:
        buf, _, size = kernel._slot()
        assert kernel.arg_bytes == kernel.params.end == size.value == len(buf), kernel.names


def _constant(source: str, name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\w+);", (CSRC / source).read_text())
    assert m, f"{name} not in {source}"
    value = m.group(1)
    return int(value) if value.isdigit() else _constant(source, value)


def test_launch_constants_match_the_sources():
    assert (modulate_mod._THREADS, modulate_mod._ROWS_IN_FLIGHT) == (
        _constant("modulate_scale_shift.cu", "kThreads"), _constant("modulate_scale_shift.cu", "kRowsInFlight"))
    assert (gated_residual_mod._THREADS, gated_residual_mod._ROWS_IN_FLIGHT) == (
        _constant("gated_residual.cu", "kThreads"), _constant("gated_residual.cu", "kRowsInFlight"))
    assert (gelu_cat_mod._THREADS, gelu_cat_mod._ROWS_IN_FLIGHT, gelu_cat_mod._BLOCKS_PER_SM) == tuple(
        _constant("gelu_cat.cu", n) for n in ("kThreads", "kRowsInFlight", "kBlocksPerSm"))
    assert (silu_mul_mod._THREADS, silu_mul_mod._ROWS_IN_FLIGHT, silu_mul_mod._BLOCKS_PER_SM) == tuple(
        _constant("silu_mul.cu", n) for n in ("kThreads", "kRowsInFlight", "kBlocksPerSm"))
    assert (cat_heads_mod._THREADS, cat_heads_mod._ROWS_IN_FLIGHT, cat_heads_mod._BLOCKS_PER_SM) == tuple(
        _constant("cat_heads.cu", n) for n in ("kThreads", "kRowsInFlight", "kBlocksPerSm"))
    assert rmsnorm_mod._WARPS_PER_BLOCK == _constant("rmsnorm_scale_shift.cu", "kWarpsPerBlock")
    assert rmsnorm_mod._ROWS64_PER_BLOCK == _constant("rmsnorm_scale_shift.cu", "kWarpsPerBlock") * 4 * _constant(
        "rmsnorm_scale_shift.cu", "kRows64PerGroup")
    assert rmsnorm_mod._ROWS128_PER_BLOCK == _constant("rmsnorm_scale_shift.cu", "kWarpsPerBlock") * _constant(
        "rmsnorm_scale_shift.cu", "kRows128PerWarp")
    assert (rmsnorm_mod._WARP_ROW_WIDEST, rmsnorm_mod._WIDE_THREADS) == (
        _constant("rmsnorm_scale_shift.cu", "kWarpRowWidest"), 32 * _constant("rmsnorm_scale_shift.cu", "kWideWarps"))
    assert rotary_mod._THREADS == 32 * _constant("rotary.cu", "kWarps")
    assert rotary_mod._HEAD_THREADS == 32 * _constant("rotary.cu", "kHeadWarps")
    assert rotary_mod._HEAD_DIM == _constant("rotary.cu", "kHeadDim")
    assert rotary_mod._ROW_THREADS == _constant("rotary.cu", "kRowThreads")
    assert (rotary_mod._NARROW_THREADS, rotary_mod._NARROW_ROWS_PER_BLOCK, rotary_mod._NARROW_WIDEST) == (
        32 * _constant("rotary.cu", "kNarrowWarps"),
        _constant("rotary.cu", "kNarrowWarps") * _constant("rotary.cu", "kNarrowRowsPerWarp"),
        _constant("rotary.cu", "kNarrowWidest"))
    assert importlib.import_module("diffusers_fastpath.ops.rotary_half")._HALF_THREADS == _constant("rotary.cu",
                                                                                                  "kHalfThreads")
    assert importlib.import_module("diffusers_fastpath.ops.qk_norm_rotary_half")._HALF_NORM_THREADS == 32 * _constant(
        "rotary.cu", "kHalfNormWarps")
    assert importlib.import_module("diffusers_fastpath.ops.rotary_matrix")._MATRIX_THREADS == _constant(
        "rotary.cu", "kMatrixThreads")
    upsample_mod = importlib.import_module("diffusers_fastpath.ops.upsample_nearest")
    assert (upsample_mod._THREADS, upsample_mod._MAX_ROW_BLOCKS) == (
        _constant("upsample_nearest.cu", "kThreads"), _constant("upsample_nearest.cu", "kMaxRowBlocks"))
    assert (layernorm_mod._EIGHT_WARPS, layernorm_mod._VARIANT_MASK) == (
        _constant("layernorm_scale_shift.cu", "kEightWarps"), _constant("layernorm_scale_shift.cu", "kVariantMask"))
    assert layernorm_mod._ATEN_THREADS == 32 * _constant("layernorm_scale_shift.cu", "kAtenWarps")
    launched = re.findall(r"case (\d+): layernorm_scale_shift_kernel<T, S, (\d+), kGated, kTanhGate>",
                          (CSRC / "layernorm_scale_shift.cu").read_text())
    assert all(a == b for a, b in launched) and (0, *(int(a) for a, _ in launched), 12) == layernorm_mod._KVS


ROW_GRID_CASES = [  # (rows, vecs_per_row, threads, rows_in_flight, blocks_per_sm): FLUX's shapes and the odd ones
    (4096, 384, 256, 4, 8), (512, 384, 256, 4, 8), (4608, 384, 256, 4, 8), (2048, 384, 256, 4, 8), (17, 8, 256, 4, 8),
    (17, 4, 256, 4, 8), (4608, 1920, 512, 1, 16), (1, 1, 512, 1, 16), (10**7, 128, 256, 4, 8), (3, 200, 256, 4, 8),
]


@needs_nvcc
def test_row_grid_matches_elementwise_cuh(tmp_path):
    """The Python row_grid against elementwise.cuh's, compiled and run on the host (no GPU: num_sms() is 132)."""
    calls = "".join(f"  show({r}, {v}, {t}, {f}, {b});\n" for r, v, t, f, b in ROW_GRID_CASES)
    (tmp_path / "grid.cu").write_text(
        '#include <cstdio>\n#include "elementwise.cuh"\nusing namespace diffusers_fastpath;\n'
        "void show(int64_t r, int v, int t, int f, int b) {\n  RowGrid g = row_grid(r, v, t, f, b);\n"
        '  std::printf("%u %u %u %u\\n", g.grid.x, g.grid.y, g.block.x, g.block.y);\n}\n'
        f"int main() {{\n  std::printf(\"%d\\n\", num_sms());\n{calls}}}\n")
    proc = subprocess.run([NVCC, "-std=c++17", f"-I{CSRC}", str(tmp_path / "grid.cu"), "-o", str(tmp_path / "grid")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    sms, *rows = subprocess.run([str(tmp_path / "grid")], capture_output=True, text=True, check=True).stdout.split("\n")[:-1]
    for (r, v, t, f, b), line in zip(ROW_GRID_CASES, rows, strict=True):
        (gx, gy, _), (bx, by, _) = _nvrtc.row_grid(r, v, t, f, int(sms), b)
        assert line.split() == [str(gx), str(gy), str(bx), str(by)], (r, v, t, f, b)


LAYERNORM_DIMS = [4, 64, 508, 512, 516, 1024, 1536, 2048, 2432, 3072, 3076, 4096, 4100, 5120, 6144]


@needs_nvcc
def test_layernorm_kv_matches_the_cu(tmp_path):
    """The Python _kv_for (which kernel instantiation holds a row) against layernorm_scale_shift.cu's kv_for, compiled
    and run on the host."""
    calls = "".join(f'  std::printf("%d\\n", kv_for({d}));\n' for d in LAYERNORM_DIMS)
    (tmp_path / "kv.cu").write_text('#include <cstdio>\n#include "layernorm_scale_shift.cu"\n'
                                    f"using namespace diffusers_fastpath;\nint main() {{\n{calls}}}\n")
    proc = subprocess.run([NVCC, "-std=c++17", f"-I{CSRC}", *_build.KERNEL_DEFINES, str(tmp_path / "kv.cu"), "-o",
                           str(tmp_path / "kv")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([str(tmp_path / "kv")], capture_output=True, text=True, check=True).stdout.split()
    assert [int(v) for v in out] == [layernorm_mod._kv_for(d) for d in LAYERNORM_DIMS]
    assert [layernorm_mod._kv_for(d) for d in (64, 3072, 3076, 4096, 5120, 6144)] == [6, 6, 8, 8, 12, 12]


def _binding_schemas() -> dict[str, str]:
    text = "\n".join(path.read_text() for path in sorted(CSRC.glob("bindings*.cpp")))  # one file per family of ops
    out = {}
    for m in re.finditer(r'm\.def\(\s*((?:"[^"]*"\s*)+)\);', text):
        schema = "".join(re.findall(r'"([^"]*)"', m.group(1)))
        name, rest = schema.split("(", 1)
        out[name] = "(" + rest
    return out


def test_nvrtc_ops_have_the_schemas_of_bindings_cpp():
    assert {name: schema for name, schema, _ in _nvrtc.RAW_OPS} == _binding_schemas()


def test_raw_ops_register_with_torch_on_the_nvrtc_way():
    """define_raw_ops registers every bindings.cpp op (in a fresh process: registration is process-global)."""
    code = (
        "import torch\nfrom diffusers_fastpath.ops import _nvrtc\n_nvrtc.define_raw_ops()\n"
        "print('\\n'.join(str(getattr(torch.ops.diffusers_fastpath, n).default._schema) for n, _, _ in _nvrtc.RAW_OPS))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = {f"diffusers_fastpath::{name}{schema}" for name, schema in _binding_schemas().items()}
    assert set(proc.stdout.strip().splitlines()) == expected


def test_raw_ops_refuse_what_the_guard_refuses():
    """A direct call of a raw op on the NVRTC way raises for inputs its guard refuses (bindings.cpp's checks raise)."""
    impl = {name: fn for name, _, fn in _nvrtc.RAW_OPS}
    x = torch.zeros(1, 8, 64, dtype=torch.bfloat16)  # CPU: every guard refuses it
    with pytest.raises(ValueError, match="device cpu"):
        impl["_modulate_scale_shift_cuda"](x, x[:, 0], x[:, 0])
    with pytest.raises(ValueError, match="device cpu"):
        impl["_gated_residual_cuda_out"](torch.empty_like(x), x, x[:, :1], x)
    # bindings.cpp takes an fp32 gate (Wan's chain), so the NVRTC raw op does too: the dtypes pass, the device not
    with pytest.raises(ValueError, match="device cpu"):
        impl["_gated_residual_cuda"](x, x[:, :1].float(), x)
    with pytest.raises(ValueError, match="mixed dtypes"):
        impl["_gated_residual_cuda"](x, x[:, :1].half(), x)


@needs_nvrtc
def test_cache_is_warm_on_the_second_build_and_keyed_by_arch(tmp_path):
    assert _nvrtc.build(CSRC, tmp_path, "90", _build.NVRTC_FLAGS) is True
    first = _nvrtc.cache_dir
    assert _nvrtc.build(CSRC, tmp_path, "90", _build.NVRTC_FLAGS) is False
    assert _nvrtc.cache_dir == first and _nvrtc.cold_compile is False
    assert _nvrtc.build(CSRC, tmp_path, "80", _build.NVRTC_FLAGS) is True and _nvrtc.cache_dir != first
    assert set(json.loads((first / "rotary.cu.json").read_text())) == {
        n for k in _nvrtc.KERNELS if k.source == "rotary.cu" for n in k.names.values()}


def test_host_cost_measurement_runs():
    """`_nvrtc.measure_host_cost` (the per-call packing costs docs/kernels.md reports) runs; the numbers are the docs'."""
    args = (1 << 40, 2 << 40, 3 << 40, 4 << 40, 4096, 4096, 384, 18432, 18432, 0, 0)  # (no index: 0, 0)
    cost = _nvrtc.measure_host_cost(modulate_mod._NVRTC, args, number=50)
    assert set(cost) == {"pack", "slot+pack", "ctypes struct"} and all(v > 0 for v in cost.values())


@pytest.fixture
def captured_launches(monkeypatch):
    """Run the Python launchers on CPU tensors: the driver call, stream and device queries stubbed; each launch is
    recorded as (kernel, key, grid, block, the packed arguments decoded by field name)."""
    launches = []
    monkeypatch.setattr(_nvrtc, "num_sms", lambda device: 132)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    for kernel in _nvrtc.KERNELS:
        monkeypatch.setitem(kernel._functions, None, {key: key for key in kernel.names})

    def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        # extra = {BUFFER_POINTER, &buffer, BUFFER_SIZE, &size, END}: find whose buffer it is, decode it
        (kernel,) = [k for k in _nvrtc.KERNELS if getattr(k._tls, "slot", None) and ctypes.addressof(k._tls.slot[0]) == extra[1]]
        size = ctypes.c_size_t.from_address(extra[3]).value
        # the buffer ends at the last parameter: a list's tail padding makes the driver refuse the launch (701)
        assert size == kernel.params.end <= kernel.params.size, (kernel.names, size)
        raw = ctypes.string_at(extra[1], size).ljust(kernel.params.size, b"\0")
        launches.append((kernel, fn, (gx, gy, gz), (bx, by, bz), kernel.params.ctype.from_buffer_copy(raw)))
        return 0

    monkeypatch.setattr(_nvrtc, "_launch", launch)
    return launches


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def test_launchers_pass_what_bindings_cpp_passes(captured_launches):
    """Each launcher's arguments, field by field, as bindings.cpp and the .cu launch() fill them (catches a value in
    the wrong slot, which the layout tests cannot see)."""
    # modulate: adaLN chunk views (batch stride 6 * D), one broadcast row
    x, emb = _bf16(2, 33, 128), _bf16(2, 6 * 128)
    shift, scale = emb.chunk(6, dim=1)[:2]
    out = modulate_mod._nvrtc_kernel(x, scale, shift)
    kernel, key, grid, block, a = captured_launches[-1]
    assert (kernel, key) == (modulate_mod._NVRTC, torch.bfloat16) and out.shape == x.shape
    assert (a.out, a.x, a.scale, a.shift) == (out.data_ptr(), x.data_ptr(), scale.data_ptr(), shift.data_ptr())
    assert (a.rows, a.seq, a.vecs_per_row, a.scale_batch_stride, a.shift_batch_stride) == (66, 33, 16, 768, 768)
    assert (grid, block) == _nvrtc.row_grid(66, 16, 256, 4, 132)
    modulate_mod._nvrtc_kernel(x, scale[:1], shift[:1])
    assert (captured_launches[-1][4].scale_batch_stride, captured_launches[-1][4].shift_batch_stride) == (0, 0)

    # gated residual: a row gate (gate.unsqueeze(1)) and a full gate
    residual, update = _bf16(2, 33, 128), _bf16(2, 33, 128)
    gate = emb.chunk(6, dim=1)[2].unsqueeze(1)
    gated_residual_mod._nvrtc_kernel(residual, gate, update)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.bfloat16, True) and (a.gate_batch_stride, a.gate_seq_stride) == (768, 0)
    assert (a.residual, a.gate, a.update, a.rows, a.seq, a.vecs_per_row) == (
        residual.data_ptr(), gate.data_ptr(), update.data_ptr(), 66, 33, 16)
    gated_residual_mod._nvrtc_kernel(residual, update, update)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.bfloat16, False) and (a.gate_batch_stride, a.gate_seq_stride) == (33 * 128, 128)
    # Wan's chain: an fp32 gate, a chunk of an fp32 [B, 6, D] adaLN table (strides in fp32 elements)
    gate32 = torch.randn(2, 6, 128).chunk(6, dim=1)[2]
    gated_residual_mod._nvrtc_kernel(residual, gate32, update)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.float32, True) and (a.gate, a.gate_batch_stride, a.gate_seq_stride) == (
        gate32.data_ptr(), 768, 0)

    # gelu_cat: attn a column slice of a wider tensor (strided rows, not flat at batch 2), fp16
    wide, mlp = torch.randn(2, 17, 96).half(), torch.randn(2, 17, 256).half()
    attn = wide[:, :, :64]
    out = gelu_cat_mod._nvrtc_kernel(attn, mlp)
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.float16, True) and out.shape == (2, 17, 320)  # stride_b == seq * stride_s: flat
    assert (a.a.attn, a.a.mlp, a.a.batch, a.a.seq, a.a.attn_dim, a.a.mlp_dim) == (
        attn.data_ptr(), mlp.data_ptr(), 2, 17, 64, 256)
    assert (a.a.attn_stride_b, a.a.attn_stride_s, a.a.mlp_stride_b, a.a.mlp_stride_s) == (17 * 96, 96, 17 * 256, 256)
    assert (a.a.dtype, a.attn_vecs, a.vecs_per_row) == (0, 8, 40)
    assert (grid, block) == _nvrtc.row_grid(34, 40, 512, 1, 132, 16)
    gelu_cat_mod._nvrtc_kernel(torch.randn(2, 40, 96).half()[:, :17, :64], mlp)
    assert captured_launches[-1][1] == (torch.float16, False)  # attn's batch stride is not seq * row stride

    # cat_heads: SD3's operands, [B, H, S, D] views of [B, S, H, D] projections (image 12 tokens, text 5), fp16
    img, txt = torch.randn(2, 12, 3, 64).half().transpose(1, 2), torch.randn(2, 5, 3, 64).half().transpose(1, 2)
    out = cat_heads_mod._nvrtc_kernel(img, txt)
    _, key, grid, block, a = captured_launches[-1]
    assert key == torch.float16 and out.shape == (2, 3, 17, 64) and out.is_contiguous()
    assert (a.a.out, a.a.a, a.a.b, a.a.batch, a.a.heads, a.a.seq_a, a.a.seq_b, a.a.dim) == (
        out.data_ptr(), img.data_ptr(), txt.data_ptr(), 2, 3, 12, 5, 64)
    assert (a.a.a_stride_b, a.a.a_stride_h, a.a.a_stride_s) == (12 * 3 * 64, 64, 3 * 64)
    assert (a.a.b_stride_b, a.a.b_stride_h, a.a.b_stride_s, a.a.dtype, a.vecs_per_row) == (5 * 3 * 64, 64, 3 * 64, 0, 8)
    assert (grid, block) == _nvrtc.row_grid(2 * 3 * 17, 8, 256, 4, 132, 8)

    # silu_mul: the two chunk(2, dim=-1) halves of one [2, 17, 256] bf16 projection (row stride 256, the second half
    # 128 elements in)
    gate, up = _bf16(2, 17, 256).chunk(2, dim=-1)
    out = silu_mul_mod._nvrtc_kernel(gate, up)
    _, key, grid, block, a = captured_launches[-1]
    assert key == torch.bfloat16 and out.shape == (2, 17, 128) and out.is_contiguous()
    assert (a.a.out, a.a.gate, a.a.up, a.a.batch, a.a.seq, a.a.dim) == (
        out.data_ptr(), gate.data_ptr(), up.data_ptr(), 2, 17, 128)
    assert (a.a.gate_stride_b, a.a.gate_stride_s, a.a.up_stride_b, a.a.up_stride_s, a.a.dtype, a.vecs_per_row) == (
        17 * 256, 256, 17 * 256, 256, 1, 16)
    assert (a.a.out_stride_b, a.a.out_stride_s) == (17 * 128, 128)  # a contiguous out
    assert (grid, block) == _nvrtc.row_grid(34, 16, 512, 1, 132, 16)
    # swiglu_cat's out: the SwiGLU columns of a [2, 17, 64 + 128] concatenation buffer (rows 192 wide, 64 in)
    buf = torch.empty(2, 17, 64 + 128).to(torch.bfloat16)
    silu_mul_mod._nvrtc_kernel(gate, up, buf[..., 64:])
    a = captured_launches[-1][-1]
    assert (a.a.out, a.a.out_stride_b, a.a.out_stride_s) == (buf[..., 64:].data_ptr(), 17 * 192, 192)
    with pytest.raises(ValueError, match="aligned-rows"):  # overlapping rows
        silu_mul_mod._nvrtc_kernel(gate, up, buf.as_strided((2, 17, 128), (17 * 192, 64, 1)))
    # sigmoid_mul: the same .cu's other kernel, silu_mul's arguments (Krea 2's gate and attention output, contiguous)
    x, g = _bf16(2, 17, 128), _bf16(2, 17, 128)
    out = sigmoid_mul_mod._nvrtc_kernel(g, x)
    kernel, key, grid, block, a = captured_launches[-1]
    assert (kernel, key) == (sigmoid_mul_mod._NVRTC, torch.bfloat16) and out.shape == x.shape and out.is_contiguous()
    assert (a.a.out, a.a.gate, a.a.up, a.a.batch, a.a.seq, a.a.dim, a.vecs_per_row) == (
        out.data_ptr(), g.data_ptr(), x.data_ptr(), 2, 17, 128, 16)
    assert (a.a.gate_stride_b, a.a.gate_stride_s, a.a.up_stride_b, a.a.out_stride_s) == (17 * 128, 128, 17 * 128, 128)
    assert (grid, block) == _nvrtc.row_grid(34, 16, 512, 1, 132, 16)

    # layernorm: one block of (32, 4) per row, of the kernel holding the row's vectors; the probe's, its eight-warp bit
    x = _bf16(2, 17, 64)
    layernorm_mod._nvrtc_kernel(x, scale[:, :64], shift[:, :64], 1e-6)
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.bfloat16, 6, False) and (grid, block) == ((34, 1, 1), (32, 4, 1))
    assert (a.a.batch, a.a.seq, a.a.dim, a.a.scale_batch_stride, a.a.variant, a.a.probe, a.a.dtype,
            a.a.modulate_fp32) == (2, 17, 64, 768, 0, False, 1, False)
    assert a.a.eps == struct.unpack("f", struct.pack("f", 1e-6))[0]
    layernorm_mod._nvrtc_kernel(x, scale[:, :64], shift[:, :64], 1e-6, variant=64 + 3, probe=True)
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.bfloat16, 0, False) and block == (32, 8, 1) and (a.a.variant, a.a.probe) == (67, True)
    assert grid == (34, 1, 1)
    layernorm_mod._nvrtc_kernel(_bf16(1, 500, 6144), _bf16(1, 6144), _bf16(1, 6144), 1e-6)
    assert captured_launches[-1][1:3] == ((torch.bfloat16, torch.bfloat16, 12, False), (500, 1, 1))  # one block per row
    # Wan's fp32 modulate: fp32 rows of an fp32 [B, 6, D] table (batch stride 6 * 64 fp32 elements)
    table = torch.randn(2, 6, 64)
    layernorm_mod._nvrtc_kernel(x, table[:, 1], table[:, 0], 1e-6)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.float32, 6, False) and (a.a.scale_batch_stride, a.a.modulate_fp32) == (384, True)
    assert a.a.affine is False
    # Wan's norm2: the norm's own fp32 weight and bias as [1, D] rows, the affine epilogue
    weight, bias = torch.randn(64), torch.randn(64)
    layernorm_mod._nvrtc_affine(x, weight, bias, 1e-6)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.float32, 6, False) and (a.a.affine, a.a.modulate_fp32) == (True, True)
    assert (a.a.scale, a.a.shift, a.a.scale_batch_stride, a.a.shift_batch_stride) == (
        weight.data_ptr(), bias.data_ptr(), 0, 0)
    assert (a.a.gated, a.a.x_out, a.a.gate, a.a.update) == (False, None, None, None)
    # gated: the residual as x, the gate rows' batch stride (a chunk of a [B, 6 * D] table), both outputs
    update, table6 = _bf16(2, 17, 64), _bf16(2, 6 * 64)
    x_out, out = layernorm_mod._nvrtc_gated_kernel(x, table6[:, None, 128:192], update, table6[:, 64:128],
                                                   table6[:, :64], 1e-6)
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.bfloat16, 6, True) and (grid, block) == ((34, 1, 1), (32, 4, 1))
    assert (a.a.gated, a.a.x, a.a.x_out, a.a.out, a.a.update) == (
        True, x.data_ptr(), x_out.data_ptr(), out.data_ptr(), update.data_ptr())
    assert (a.a.gate, a.a.gate_batch_stride, a.a.scale_batch_stride) == (table6[:, 128:].data_ptr(), 384, 384)
    assert (a.a.scale_seq_stride, a.a.shift_seq_stride, a.a.norm_weight, a.a.norm_bias) == (0, 0, None, None)
    # layernorm_modulate: FLUX.3's per-token rows (chunks of a [B, S, 3D] modulation: seq stride 3D, batch stride
    # 3SD) with the norm's fp32 weight and bias; a [B, 1, D] row per sample has seq stride 0
    mod, weight, bias = _bf16(2, 17, 3 * 64), torch.randn(64), torch.randn(64)
    layernorm_modulate_mod._nvrtc_modulate(x, mod[..., 64:128], mod[..., :64], weight, bias, 1e-6)
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.bfloat16, torch.bfloat16, 6, False) and (grid, block) == ((34, 1, 1), (32, 4, 1))
    assert (a.a.scale, a.a.shift, a.a.scale_batch_stride, a.a.shift_batch_stride) == (
        mod[..., 64:].data_ptr(), mod.data_ptr(), 17 * 192, 17 * 192)
    assert (a.a.scale_seq_stride, a.a.shift_seq_stride, a.a.norm_weight, a.a.norm_bias) == (
        192, 192, weight.data_ptr(), bias.data_ptr())
    assert (a.a.modulate_fp32, a.a.affine, a.a.gated) == (False, False, False)
    layernorm_modulate_mod._nvrtc_modulate(x, mod[:, :1, 64:128], mod[:, :1, :64], None, None, 1e-6)
    a = captured_launches[-1][-1]
    assert (a.a.scale_seq_stride, a.a.shift_seq_stride, a.a.norm_weight, a.a.norm_bias) == (0, 0, None, None)
    layernorm_modulate_mod._nvrtc_modulate(x, mod[..., 64:128], None, None, None, 1e-6)  # scale only: a null shift
    a = captured_launches[-1][-1]
    assert (a.a.shift, a.a.shift_batch_stride, a.a.shift_seq_stride, a.a.scale_seq_stride) == (None, 0, 0, 192)

    # rmsnorm alone over rows of 64 and 128: several rows per warp (kRows64PerBlock, kRows128PerBlock per block)
    for d, per_block in ((64, 64), (128, 32), (96, 8)):
        rmsnorm_plain_mod._nvrtc_kernel(_bf16(1000, 1, d), _bf16(d), 1e-6)
        assert captured_launches[-1][2] == (-(-1000 // per_block), 1, 1), d
    # and over rows wider than 8160 (Ideogram 4's 53248): the wide kernel, one row per block of 16 warps
    for d, kernel, grid, block in ((8160, rmsnorm_mod._NVRTC, (125, 1, 1), (256, 1, 1)),
                                   (8164, rmsnorm_mod._NVRTC_WIDE, (1000, 1, 1), (512, 1, 1))):
        xw, ww = _bf16(1000, 1, d), _bf16(d)
        out = rmsnorm_plain_mod._nvrtc_kernel(xw, ww, 1e-6)
        launched, key, got_grid, got_block, a = captured_launches[-1]
        assert (launched, got_grid, got_block) == (kernel, grid, block), d
        assert (a.a.out, a.a.x.ptr, a.a.weight, a.a.dim, a.a.epilogue) == (out.data_ptr(), xw.data_ptr(),
                                                                          ww.data_ptr(), d, rmsnorm_mod.PLAIN)
    # rmsnorm_modulate (LTX-Video): a weightless norm passes a null weight; per-token rows of a [B, T, 6, D] table
    xm = _bf16(2, 20, 640)
    shift_m, scale_m = _bf16(2, 20, 6, 640).unbind(dim=2)[:2]
    rmsnorm_modulate_mod._nvrtc_kernel(xm, None, scale_m, shift_m, 1e-6)
    _, key, grid, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, rmsnorm_mod.MODULATE) and not a.a.weight and a.a.epilogue == 6
    assert (a.a.scale.ptr, a.a.scale.stride_s, a.a.scale.stride_b) == (scale_m.data_ptr(), 20 * 6 * 640, 6 * 640)
    assert (a.a.seq, a.a.batch, a.a.dim, grid) == (2, 20, 640, (5, 1, 1))

    # rmsnorm: [seq, batch, dim] operands as Rows (pointer, stride(0), stride(1)); gated writes residual_out
    seq, batch, dim = 20, 2, 1024
    xs = [_bf16(seq, batch, dim) for _ in range(5)]
    weight = _bf16(dim)
    res_out, out = rmsnorm_mod._nvrtc_gated_kernel(xs[0], xs[1], xs[2], weight, xs[3], xs[4], 1e-5)
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.bfloat16, True, 0) and (grid, block) == ((5, 1, 1), (256, 1, 1))
    assert (a.a.out, a.a.residual_out, a.a.weight) == (out.data_ptr(), res_out.data_ptr(), weight.data_ptr())
    for field, t in zip(("x", "gate", "update", "scale", "shift"), xs):
        rows = getattr(a.a, field)
        assert (rows.ptr, rows.stride_s, rows.stride_b) == (t.data_ptr(), batch * dim, dim), field
    f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]  # noqa: E731
    assert (a.a.seq, a.a.batch, a.a.dim, a.a.gated, a.a.eps, a.a.epilogue) == (seq, batch, dim, True, f32(1e-5), 0)
    assert a.a.mean_factor == f32(f32(40) / f32(40 * dim)) and a.a.residual.ptr is None
    rmsnorm_mod._nvrtc_kernel(xs[0], weight, xs[3], xs[4], 1e-5)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, 0) and a.a.residual_out is None and a.a.gate.ptr is None
    # Z-Image's sandwich norms: the scale (kScale = 1) and the gated residual after the norm (kGatedResidual = 2), with
    # rows broadcast over the sequence (stride 0)
    row = xs[1][:1].expand(seq, -1, -1)
    rmsnorm_mod._nvrtc_scale_kernel(xs[0], weight, row, 1e-5)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, 1) and a.a.epilogue == 1 and not a.a.gated
    assert (a.a.scale.ptr, a.a.scale.stride_s, a.a.scale.stride_b, a.a.shift.ptr) == (row.data_ptr(), 0, dim, None)
    rmsnorm_mod._nvrtc_gated_residual_kernel(xs[2], row, xs[0], weight, 1e-5)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, 2) and a.a.epilogue == 2 and a.a.update.ptr is None
    assert (a.a.gate.ptr, a.a.gate.stride_s, a.a.residual.ptr, a.a.x.ptr) == (
        row.data_ptr(), 0, xs[2].data_ptr(), xs[0].data_ptr())
    assert (a.a.index, a.a.table_rows) == (None, 0)  # (no index: the epilogues of tensor operands)
    # ... and Bria FIBO 2's select_per_token rows (kScaleRows = 8, kGatedResidualRows = 9): a [rows, dim] table (here
    # chunks of a [4, 2 * dim] one: row stride 2 * dim) read at row index[r] of norm row r
    table, index = _bf16(4, 2 * dim)[:, dim:], torch.zeros(seq, batch, dtype=torch.int32)
    rmsnorm_mod._nvrtc_scale_rows_kernel(xs[0], weight, table, index, 1e-5)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, 8) and a.a.epilogue == 8 and a.a.gate.ptr is None
    assert (a.a.scale.ptr, a.a.scale.stride_s, a.a.scale.stride_b) == (table.data_ptr(), 2 * dim, 0)
    assert (a.a.index, a.a.table_rows, a.a.seq, a.a.batch) == (index.data_ptr(), 4, seq, batch)
    rmsnorm_mod._nvrtc_gated_residual_rows_kernel(xs[2], table, index, xs[0], weight, 1e-5)
    _, key, _, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, 9) and a.a.epilogue == 9 and a.a.scale.ptr is None
    assert (a.a.gate.ptr, a.a.gate.stride_s, a.a.gate.stride_b) == (table.data_ptr(), 2 * dim, 0)
    assert (a.a.residual.ptr, a.a.x.ptr, a.a.index, a.a.table_rows) == (
        xs[2].data_ptr(), xs[0].data_ptr(), index.data_ptr(), 4)
    # (rows of 128: one a warp, as every indexed row; the rows-of-128 path is not theirs: rows_per_block)
    rmsnorm_mod._nvrtc_scale_rows_kernel(_bf16(1000, 1, 128), _bf16(128), _bf16(4, 128),
                                         torch.zeros(1000, 1, dtype=torch.int32), 1e-5)
    assert captured_launches[-1][2] == (125, 1, 1)

    # rotary with the norm and a text part; without a text part
    x_img, x_txt = _bf16(1, 17, 3, 64), _bf16(1, 5, 3, 64)
    cos = torch.randn(22, 64)
    w_txt, w_img = _bf16(64), _bf16(64)
    out = qk_mod._nvrtc_kernel(x_txt, w_txt, 1e-6, x_img, w_img, 1e-5, cos, cos)
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.bfloat16, True, 0) and (grid, block) == ((22, 1, 1), (256, 1, 1)) and out.shape == (1, 22, 3, 64)
    assert (a.a.txt.ptr, a.a.txt.seq, a.a.txt.weight, a.a.txt.eps) == (x_txt.data_ptr(), 5, w_txt.data_ptr(), f32(1e-6))
    assert (a.a.img.stride_b, a.a.img.stride_s, a.a.img.stride_h, a.a.img.seq) == (17 * 192, 192, 64, 17)
    assert (a.a.img.weight, a.a.img.eps, a.a.batch, a.a.heads, a.a.dim, a.a.norm) == (w_img.data_ptr(), f32(1e-5), 1, 3, 64, True)
    # FLUX's form at dim 128: head_norm_rotary_kernel, 128 threads a row
    x128_img, x128_txt, cos128 = _bf16(2, 9, 3, 128), _bf16(2, 4, 3, 128), torch.randn(13, 128)
    w128 = _bf16(128)
    out = qk_mod._nvrtc_kernel(x128_txt, w128, 1e-6, x128_img, w128, 1e-6, cos128, cos128)
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.bfloat16, 1) and (grid, block) == ((13, 2, 1), (128, 1, 1)) and out.shape == (2, 13, 3, 128)
    assert (a.a.txt.seq, a.a.img.seq, a.a.heads, a.a.dim, a.a.norm, a.a.cos_stride_s) == (4, 9, 3, 128, True, 128)
    rotary_mod._nvrtc_kernel(x128_img, cos128[:9], cos128[:9])  # without the norm: the same kernel's other form
    _, key, grid, block, a = captured_launches[-1]
    assert key == (torch.bfloat16, 0) and (grid, block) == ((9, 2, 1), (128, 1, 1)) and not a.a.norm
    rotary_mod._nvrtc_kernel(x_img, cos[:17], cos[:17])
    _, key, grid, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, 0) and grid == (17, 1, 1) and (a.a.txt.ptr, a.a.txt.seq, a.a.img.weight) == (None, 0, None)
    assert (a.a.cos_stride_b, a.a.cos_stride_s, a.a.cos_stride_h) == (0, 64, 0)  # one [seq, dim] table for all heads
    # LTX-Video's rows: [B, S, C] as heads of head_dim, per-sample [B or 1, S, C] tables read per head
    rows, table = _bf16(2, 9, 256), torch.randn(2, 9, 256)
    out = rotary_mod._nvrtc_kernel_rows(rows, table, table, 128)
    _, key, grid, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, 1) and grid == (9, 2, 1) and out.shape == (2, 9, 256)
    assert (a.a.heads, a.a.dim, a.a.cos_stride_b, a.a.cos_stride_s, a.a.cos_stride_h) == (2, 128, 9 * 256, 256, 128)
    rotary_mod._nvrtc_kernel_rows(rows, table[:1], table[:1], 64)
    a = captured_launches[-1][4]
    assert (a.a.heads, a.a.dim, a.a.cos_stride_b, a.a.cos_stride_s, a.a.cos_stride_h) == (4, 64, 0, 256, 64)
    # Wan's pairing: one [seq, dim] table, the wan flag
    rotary_mod._nvrtc_kernel_wan(x_img, cos[:17], cos[:17])
    _, key, grid, _, a = captured_launches[-1]
    assert key == (torch.bfloat16, False, 2) and grid == (17, 1, 1) and (a.a.wan, a.a.norm, a.a.cos_stride_h) == (True, False, 0)

    # Kandinsky's matrix form: x [rows, heads, dim], one float32 [table_rows, 2 * dim] table row per token
    matrix_mod = importlib.import_module("diffusers_fastpath.ops.rotary_matrix")
    xm, rope = _bf16(6, 3, 64), torch.randn(3, 128)
    out = matrix_mod._nvrtc_kernel(xm, rope)
    kernel, key, grid, block, a = captured_launches[-1]
    assert (kernel, key, grid, block) == (matrix_mod._NVRTC, torch.bfloat16, (6, 1, 1), (256, 1, 1))
    assert (a.a.out, a.a.x, a.a.rope, a.a.rows, a.a.heads, a.a.dim, a.a.table_rows, a.a.dtype) == (
        out.data_ptr(), xm.data_ptr(), rope.data_ptr(), 6, 3, 64, 3, 1) and out.shape == xm.shape

    # the VAE's 2x upsampling: [N, C, H, W] (here time-major: [C, N, H, W] memory), columns x rows, a capped grid
    upsample_mod = importlib.import_module("diffusers_fastpath.ops.upsample_nearest")
    xu = torch.randn(3, 2, 5, 7).half().transpose(0, 1)
    out = upsample_mod._nvrtc_kernel(xu)
    kernel, key, grid, block, a = captured_launches[-1]
    assert (kernel, key, grid, block) == (upsample_mod._NVRTC, torch.float16, (1, 30, 1), (256, 1, 1))
    assert (a.a.out, a.a.x, a.a.batch, a.a.channels, a.a.height, a.a.width, a.a.dtype) == (
        out.data_ptr(), xu.data_ptr(), 2, 3, 5, 7, 0)
    assert (a.a.stride_n, a.a.stride_c, a.a.stride_h) == (35, 70, 7) and out.shape == (2, 3, 10, 14)
    assert out.is_contiguous()
    upsample_mod._nvrtc_kernel(torch.empty(16, 64, 128, 300, dtype=torch.bfloat16))
    assert captured_launches[-1][2] == (2, 65535, 1)  # 131072 rows: the cap (a grid-stride loop over rows)

    # an _out variant's output is checked as bindings.cpp checks it, before anything is launched
    count = len(captured_launches)
    for bad in (torch.empty(1, 17, 3, 64, dtype=torch.float16), torch.empty(1, 17, 3, 128, dtype=torch.bfloat16)[..., :64]):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            rotary_mod._nvrtc_kernel(x_img, cos[:17], cos[:17], out=bad)
    assert len(captured_launches) == count


# --- CPU: which way ------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_loader(monkeypatch):
    """A process that has not loaded kernels yet; loader state and the ops' cached entry points restored afterwards."""
    for name in ("unavailable", "load_seconds", "cold_build", "backend"):
        monkeypatch.setattr(_build, name, None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.delenv(_build.ENV_KERNELS, raising=False)
    # the op's entry point not resolved yet, its NVRTC launcher read at the launch (a test replaces it)
    monkeypatch.setattr(modulate_mod, "_cuda_op", _build.LazyLauncher(lambda *args: modulate_mod._nvrtc_kernel(*args),
                                                                      "_modulate_scale_shift_cuda"))
    calls = []

    def fake_nvcc_build():
        calls.append("nvcc")
        _build.backend, _build.load_seconds, _build.cold_build = "nvcc", 0.1, False

    def fake_nvrtc_build():
        calls.append("nvrtc")
        _build.backend, _build.load_seconds, _build.cold_build = "nvrtc", 0.1, False

    monkeypatch.setattr(_build, "_build_and_load", fake_nvcc_build)
    monkeypatch.setattr(_build, "_compile_and_load_nvrtc", fake_nvrtc_build)
    return calls


def _warnings(log) -> list[str]:
    return [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]


def test_toolkit_present_takes_nvcc(monkeypatch, fresh_loader, fastpath_log):
    monkeypatch.setattr(_build, "_toolkit_missing", lambda: None)
    monkeypatch.setattr(_build, "_nvrtc_missing", lambda: None)
    assert _build.load_extension() == "nvcc" and fresh_loader == ["nvcc"]
    assert _warnings(fastpath_log) == []


def test_no_toolkit_but_nvrtc_takes_nvrtc_and_the_ops_launch_through_it(monkeypatch, fresh_loader, fastpath_log):
    monkeypatch.setattr(_build, "_toolkit_missing", lambda: "no CUDA compiler found (nvcc: CUDA_HOME=unset)")
    monkeypatch.setattr(_build, "_nvrtc_missing", lambda: None)
    launched = []
    monkeypatch.setattr(modulate_mod, "_nvrtc_kernel", lambda *args: launched.append(args) or "out")
    assert modulate_mod._kernel(1, 2, 3) == "out" and launched == [(1, 2, 3)]
    assert fresh_loader == ["nvrtc"] and _build.backend == "nvrtc"
    assert _warnings(fastpath_log) == []  # nothing is missing for the user: no warning
    assert _build.kernels_status().startswith("CUDA kernels loaded (NVRTC cache)")


def test_forced_nvrtc_skips_the_toolkit(monkeypatch, fresh_loader):
    monkeypatch.setenv(_build.ENV_KERNELS, "nvrtc")
    monkeypatch.setattr(_build, "_toolkit_missing", lambda: None)
    monkeypatch.setattr(_build, "_nvrtc_missing", lambda: None)
    assert _build.load_extension() == "nvrtc" and fresh_loader == ["nvrtc"]


def test_failed_nvcc_build_falls_back_to_nvrtc_with_one_warning(monkeypatch, fresh_loader, fastpath_log):
    monkeypatch.setattr(_build, "_toolkit_missing", lambda: None)
    monkeypatch.setattr(_build, "_nvrtc_missing", lambda: None)

    def failing():
        fresh_loader.append("nvcc")
        raise OSError("Could not load this library: diffusers_fastpath_C.so")

    monkeypatch.setattr(_build, "_build_and_load", failing)
    assert _build.load_extension() == "nvrtc" and fresh_loader == ["nvcc", "nvrtc"]
    (warning,) = _warnings(fastpath_log)
    assert "failed to build or load (OSError: Could not load" in warning and "Using the NVRTC kernels" in warning


def test_neither_way_warns_once_naming_both(monkeypatch, fresh_loader, fastpath_log):
    monkeypatch.setattr(_build, "_toolkit_missing", lambda: "no CUDA compiler found (nvcc: CUDA_HOME=unset)")
    monkeypatch.setattr(_build, "_nvrtc_missing", lambda: "no NVRTC library found (tried libnvrtc.so.13)")
    for _ in range(3):
        with pytest.raises(_build.KernelsUnavailable):
            _build.load_extension()
    (warning,) = _warnings(fastpath_log)
    assert "no CUDA compiler found" in warning and "no NVRTC library found" in warning
    assert "pip install nvidia-cuda-nvrtc" in warning and fresh_loader == []
    assert _build.kernels_status() == f"no CUDA kernels: {_build.unavailable}"


def test_an_ops_launcher_is_asked_for_until_it_comes_then_kept(monkeypatch):
    """`LazyLauncher`: each launch asks `launcher` again while it raises (no kernels: nothing kept), then never."""
    asked = []

    def fake_launcher(nvrtc_fn, raw_op):
        asked.append(raw_op)
        if len(asked) < 3:
            raise _build.KernelsUnavailable("no CUDA kernels (simulated)")
        return nvrtc_fn

    monkeypatch.setattr(_build, "launcher", fake_launcher)
    launch = _build.LazyLauncher(lambda *args: args, "_x_cuda")
    for _ in range(2):
        with pytest.raises(_build.KernelsUnavailable):
            launch(1)
    assert launch(1, 2) == (1, 2) and launch(3) == (3,) and asked == ["_x_cuda"] * 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer; the GPU tests below take NVRTC's")
def test_nvrtc_missing_names_the_cause_without_a_gpu():
    """On this machine (no GPU, maybe no driver) the real check says why NVRTC cannot run, and logs nothing."""
    reason = _build._nvrtc_missing()
    assert reason is not None and ("libcuda" in reason or "no CUDA device" in reason or "NVRTC" in reason), reason


# --- GPU -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def both_ways():
    """The nvcc extension (when a toolkit is there) and the NVRTC cubins, in one process: the NVRTC launchers are
    called directly, the extension through its ops."""
    nvcc = _build.load_extension() == "nvcc"  # the raw ops: the extension's, else the NVRTC ones
    major, minor = torch.cuda.get_device_capability()
    _nvrtc.build(CSRC, _build.cache_root(), f"{major}{minor}", _build.NVRTC_FLAGS)
    return nvcc


FLUX_ROWS = [(1, 4096, 3072), (1, 512, 3072), (1, 4608, 3072), (2, 1024, 3072), (1, 17, 64)]
DTYPES = [torch.bfloat16, torch.float16]


def _rand(shape, dtype, gen, scale=4.0):
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_ROWS, ids=str)
def test_row_ops_through_nvrtc_equal_nvcc_and_eager(shape, dtype, both_ways):
    gen = torch.Generator(device="cuda").manual_seed(shape[1])
    b, l, d = shape
    x, update = _rand(shape, dtype, gen), _rand(shape, dtype, gen)
    emb = _rand((b, 6 * d), dtype, gen, 1.0)
    shift, scale, gate = emb.chunk(6, dim=1)[:3]
    ops = torch.ops.diffusers_fastpath
    cases = [
        (modulate_mod._nvrtc_kernel(x, scale, shift), modulate_mod.modulate_scale_shift_ref(x, scale, shift),
         "_modulate_scale_shift_cuda", (x, scale, shift)),
        (gated_residual_mod._nvrtc_kernel(x, gate.unsqueeze(1), update),
         gated_residual_mod.gated_residual_ref(x, gate.unsqueeze(1), update), "_gated_residual_cuda",
         (x, gate.unsqueeze(1), update)),
        (gated_residual_mod._nvrtc_kernel(x, update, update), gated_residual_mod.gated_residual_ref(x, update, update),
         "_gated_residual_cuda", (x, update, update)),
    ]
    if d <= layernorm_mod.MAX_DIM:
        norm = torch.nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        cases.append((layernorm_mod._nvrtc_kernel(x, scale, shift, 1e-6),
                      layernorm_mod.layernorm_scale_shift_ref(norm, x, scale, shift), "_layernorm_scale_shift_cuda",
                      (x, scale, shift, 1e-6)))
        gate_row = gate.unsqueeze(1)  # the gated chain: both outputs, through each way
        x_new, normed = layernorm_mod._nvrtc_gated_kernel(x, gate_row, update, scale, shift, 1e-6)
        x_ref, normed_ref = layernorm_mod.gated_layernorm_scale_shift_ref(norm, x, gate_row, update, scale, shift)
        gated_args = (x, gate_row, update, scale, shift, 1e-6)
        cases.append((x_new, x_ref, "_gated_layernorm_scale_shift_cuda#0", gated_args))  # #i: the op's i-th output
        cases.append((normed, normed_ref, "_gated_layernorm_scale_shift_cuda#1", gated_args))
        from diffusers.models.normalization import FP32LayerNorm  # Wan's norm2: fp32 affine, one rounding

        norm2 = FP32LayerNorm(d, eps=1e-6).to(device="cuda", dtype=dtype)
        with torch.no_grad():
            norm2.weight.copy_(_rand((d,), dtype, gen, 0.2) + 1)
            norm2.bias.copy_(_rand((d,), dtype, gen, 0.1))
        w32, b32 = norm2.weight.float(), norm2.bias.float()
        cases.append((layernorm_mod._nvrtc_affine(x, w32, b32, 1e-6), layernorm_mod.layernorm_affine_fp32_ref(norm2, x),
                      "_layernorm_affine_fp32_cuda", (x, w32, b32, 1e-6)))
        # FLUX.3's per-token rows with the norm's own affine (EasyAnimate's FP32LayerNorm) and without (FLUX.3)
        mod = _rand((b, l, 3 * d), dtype, gen, 1.0)
        shift3, scale3 = mod[..., :d], mod[..., d:2 * d]
        for norm_m, rows in ((norm2, (w32, b32)), (norm, (None, None))):
            cases.append((layernorm_modulate_mod._nvrtc_modulate(x, scale3, shift3, *rows, norm_m.eps),
                          layernorm_modulate_mod.layernorm_modulate_ref(norm_m, x, scale3, shift3),
                          "_layernorm_modulate_cuda", (x, scale3, shift3, *rows, norm_m.eps)))
        cases.append((layernorm_modulate_mod._nvrtc_modulate(x, scale3, None, None, None, norm.eps),  # Qwen-Image 2.1
                      layernorm_modulate_mod.layernorm_scale_ref(norm, x, scale3), "_layernorm_modulate_cuda",
                      (x, scale3, None, None, None, norm.eps)))
    mlp = _rand((b, l, 4 * d), dtype, gen)
    cases.append((gelu_cat_mod._nvrtc_kernel(x, mlp), gelu_cat_mod.gelu_cat_ref(x, mlp), "_gelu_cat_cuda", (x, mlp)))
    gate_half, up_half = mlp.chunk(2, dim=-1)  # FLUX.2's SwiGLU: the two halves of one projection
    cases.append((silu_mul_mod._nvrtc_kernel(gate_half, up_half), silu_mul_mod.silu_mul_ref(gate_half, up_half),
                  "_silu_mul_cuda", (gate_half, up_half)))
    cases.append((sigmoid_mul_mod._nvrtc_kernel(gate_half, up_half),  # the same .cu's sigmoid: up * sigmoid(gate)
                  sigmoid_mul_mod.sigmoid_mul_ref(up_half, gate_half), "_sigmoid_mul_cuda", (gate_half, up_half)))
    # swiglu_cat's strided out: the SwiGLU columns of a poisoned [B, L, D + 2D] buffer, the first D left alone
    buf = torch.full((b, l, 3 * d), float("nan"), dtype=dtype, device="cuda")
    silu_mul_mod._nvrtc_kernel(gate_half, up_half, buf[..., d:])
    assert buf[..., :d].isnan().all()
    cases.append((buf[..., d:], silu_mul_mod.silu_mul_ref(gate_half, up_half), "_silu_mul_cuda", (gate_half, up_half)))
    gate32 = gate.unsqueeze(1).float()  # Wan's chain: an fp32 gate, through the raw op's own guard
    cases.append((gated_residual_mod._nvrtc_kernel(x, gate32, update),
                  gated_residual_mod.gated_residual_fp32_ref(x, gate32, update), "_gated_residual_cuda",
                  (x, gate32, update)))
    for got, ref, op, args in cases:
        assert torch.equal(got, ref), op
        # the raw op: nvcc's where a toolkit is there, else the NVRTC one (through the guard that stands for
        # bindings.cpp's checks)
        name, _, index = op.partition("#")
        raw = getattr(ops, name)(*args)
        assert torch.equal(got, raw[int(index)] if index else raw), op


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq_txt, seq_img", [(512, 4096), (0, 4608), (7, 17)])
def test_rotary_ops_through_nvrtc_equal_nvcc_and_eager(seq_txt, seq_img, dtype, both_ways):
    gen = torch.Generator(device="cuda").manual_seed(seq_img)
    heads, dim = 24, 128
    x_img = _rand((1, seq_img, heads, dim), dtype, gen, 1.0)
    x_txt = _rand((1, seq_txt, heads, dim), dtype, gen, 1.0) if seq_txt else None
    seq = seq_txt + seq_img
    angle = torch.rand(seq, dim // 2, generator=gen, device="cuda") * 100
    cos, sin = (f(angle).repeat_interleave(2, dim=1).contiguous() for f in (torch.cos, torch.sin))
    norm_img = torch.nn.RMSNorm(dim, eps=1e-6, device="cuda", dtype=dtype)
    norm_txt = torch.nn.RMSNorm(dim, eps=1e-6, device="cuda", dtype=dtype)
    with torch.no_grad():
        for n in (norm_img, norm_txt):
            n.weight.copy_(torch.rand(dim, generator=gen, device="cuda") + 0.5)
        ref = qk_mod.qk_norm_rope_ref(norm_txt, x_txt, norm_img, x_img, cos, sin)
        got = qk_mod._nvrtc_kernel(x_txt, norm_txt.weight if x_txt is not None else None, 1e-6, x_img, norm_img.weight,
                                   1e-6, cos, sin)
        assert torch.equal(got, ref)
        full = x_img if x_txt is None else torch.cat([x_txt, x_img], dim=1)
        assert torch.equal(rotary_mod._nvrtc_kernel(full, cos, sin), rotary_mod.rotary_emb_ref(full, cos, sin))
        # LTX-Video's rows form: all heads in one row, a table per sample (two samples here)
        rows = torch.cat([full, full.flip(1)]).flatten(2)
        table_cos, table_sin = (torch.stack([t.repeat(1, heads), t.flip(0).repeat(1, heads)]) for t in (cos, sin))
        ref_rows = rotary_mod.rotary_emb_rows_ref(rows, table_cos, table_sin)
        assert torch.equal(rotary_mod._nvrtc_kernel_rows(rows, table_cos, table_sin, 128), ref_rows)
        if both_ways:
            assert torch.equal(torch.ops.diffusers_fastpath._rotary_emb_rows_cuda(rows, table_cos, table_sin, 64), ref_rows)
        # Wan's pairing over the same [seq, dim] tables
        ref_wan = rotary_mod.rotary_emb_wan_ref(full, cos[None, :, None], sin[None, :, None])
        assert torch.equal(rotary_mod._nvrtc_kernel_wan(full, cos, sin), ref_wan)
        if both_ways:
            assert torch.equal(torch.ops.diffusers_fastpath._rotary_emb_wan_cuda(full, cos, sin), ref_wan)
        if both_ways:
            args = (x_txt, norm_txt.weight if x_txt is not None else None, 1e-6, x_img, norm_img.weight, 1e-6, cos, sin)
            assert torch.equal(got, torch.ops.diffusers_fastpath._qk_norm_rope_cuda(*args))
        # LTX-Video's and Wan's QK norms across all heads (C = 3072) with their rotary: the row norm, each way of
        # forming its mean square the same on both ways, the production one eager's
        norm_rows = torch.nn.RMSNorm(heads * dim, eps=1e-6, device="cuda", dtype=dtype)
        norm_rows.weight.copy_(torch.rand(heads * dim, generator=gen, device="cuda") + 0.5)
        split = rows.unflatten(2, (heads, dim))
        for wan, tables, ref_tables in ((False, (table_cos, table_sin), (table_cos, table_sin)),
                                        (True, (cos, sin), (cos[None, :, None], sin[None, :, None]))):
            ref_norm = qk_mod.qk_norm_rows_rope_ref(norm_rows, rows, *ref_tables, heads if wan else 0)
            for final in (0, 1, 2):
                got_rows = qk_mod._nvrtc_rows_kernel(split, norm_rows.weight, 1e-6, *tables, wan, final)
                if both_ways:
                    nvcc = torch.ops.diffusers_fastpath._qk_norm_rows_rope_cuda(split, norm_rows.weight, 1e-6, *tables,
                                                                               wan, final)
                    assert torch.equal(got_rows, nvcc)
                if final == qk_mod.ROW_NORM_FINAL:
                    assert torch.equal(got_rows if wan else got_rows.flatten(2), ref_norm)
        # LTX-Video's q and k as one pair (k: the rows reversed along the sequence), q's result then k's
        k_rows = rows.flip(1).contiguous()
        ref_pair = qk_mod.qk_norm_rows_rope_pair_ref(norm_rows, rows, norm_rows, k_rows, table_cos, table_sin)
        k_split = k_rows.unflatten(2, (heads, dim))
        pair_args = (split, norm_rows.weight, 1e-6, k_split, norm_rows.weight, 1e-6, table_cos, table_sin,
                     qk_mod.ROW_NORM_FINAL)
        got_pair = qk_mod._nvrtc_pair_kernel(*pair_args).flatten(3)
        assert torch.equal(got_pair[0], ref_pair[0]) and torch.equal(got_pair[1], ref_pair[1])
        if both_ways:
            nvcc_pair = torch.ops.diffusers_fastpath._qk_norm_rows_rope_pair_cuda(*pair_args).flatten(3)
            assert torch.equal(got_pair, nvcc_pair)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sandwich_rmsnorms_through_nvrtc_equal_nvcc_and_eager(dtype, both_ways):
    gen = torch.Generator(device="cuda").manual_seed(8)
    batch, seq, dim = 1, 4608, 3840  # Z-Image at 1024x1024
    x, residual = (_rand((batch, seq, dim), dtype, gen, 1.0) for _ in range(2))
    scale, gate = (_rand((batch, 1, dim), dtype, gen, 0.5).expand(batch, seq, dim) for _ in range(2))
    weight = (torch.rand(dim, generator=gen, device="cuda") + 0.5).to(dtype)
    normed = rmsnorm_mod._rms_norm(x, weight, 1e-5)
    got = rmsnorm_mod._nvrtc_scale_kernel(x, weight, scale, 1e-5)
    assert torch.equal(got, normed * scale)
    got_residual = rmsnorm_mod._nvrtc_gated_residual_kernel(residual, gate, x, weight, 1e-5)
    assert torch.equal(got_residual, residual + gate * normed)
    if both_ways:
        ops = torch.ops.diffusers_fastpath
        assert torch.equal(got, ops._rmsnorm_scale_cuda(x, weight, scale, 1e-5))
        assert torch.equal(got_residual, ops._rmsnorm_gated_residual_cuda(residual, gate, x, weight, 1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["weightless", "weighted"])
def test_rmsnorm_modulate_through_nvrtc_equals_nvcc_and_eager(weighted, dtype, both_ways):
    """LTX-Video at 768x512x121: 6,144 tokens of 2048, per-token scale/shift rows of one [B, T, 6, D] table."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = _rand((1, 6144, 2048), dtype, gen, 1.0)
    shift, scale = _rand((1, 6144, 6, 2048), dtype, gen, 0.5).unbind(dim=2)[:2]
    weight = (torch.rand(2048, generator=gen, device="cuda") + 0.5).to(dtype) if weighted else None
    normed = rmsnorm_mod._rms_norm(x, weight, 1e-6)
    got = rmsnorm_modulate_mod._nvrtc_kernel(x, weight, scale, shift, 1e-6)
    assert torch.equal(got, normed * (1 + scale) + shift)
    if both_ways:
        assert torch.equal(got, torch.ops.diffusers_fastpath._rmsnorm_modulate_cuda(x, weight, scale, shift, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 96, 128])
def test_plain_qk_rmsnorm_through_nvrtc_equals_nvcc_and_eager(dim, dtype, both_ways):
    """SD3.5's QK norm (head_dim 64: aten's scalar reduction order), Lumina2's 96, the vectorised 128."""
    gen = torch.Generator(device="cuda").manual_seed(dim)
    x = _rand((4429 * 38, 1, dim), dtype, gen, 1.0)  # SD3.5-large at 1024x1024: 4096 + 333 tokens, 38 heads
    weight = (torch.rand(dim, generator=gen, device="cuda") + 0.5).to(dtype)
    got = rmsnorm_plain_mod._nvrtc_kernel(x, weight, 1e-6)
    assert torch.equal(got, rmsnorm_mod._rms_norm(x, weight, 1e-6))
    if both_ways:
        assert torch.equal(got, torch.ops.diffusers_fastpath._rmsnorm_plain_cuda(x, weight, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_head_concatenation_through_nvrtc_equals_nvcc_and_eager(batch, dtype, both_ways):
    """SD3.5-large's joint q at 1024x1024: [B, 38, S, 64] views of the image (4096) and text (333) projections."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    img = _rand((batch, 4096, 38, 64), dtype, gen, 1.0).transpose(1, 2)
    txt = _rand((batch, 333, 38, 64), dtype, gen, 1.0).transpose(1, 2)
    ref = torch.cat([img, txt], dim=2)
    torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)  # poisons the memory the output gets
    got = cat_heads_mod._nvrtc_kernel(img, txt)
    assert torch.equal(got, ref) and got.stride() == ref.stride()
    if both_ways:
        assert torch.equal(got, torch.ops.diffusers_fastpath._cat_heads_cuda(img, txt))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_rmsnorm_through_nvrtc_equals_nvcc_and_eager(gated, dtype, both_ways):
    gen = torch.Generator(device="cuda").manual_seed(7)
    seq, batch, dim = 4216, 1, 4096  # ERNIE-Image at 1024x1024, where the H200 matched aten's reduction order
    x, gate, update = (_rand((seq, batch, dim), dtype, gen, 1.0) for _ in range(3))
    scale, shift = (_rand((seq, batch, dim), dtype, gen, 0.5) for _ in range(2))
    weight = (torch.rand(dim, generator=gen, device="cuda") + 0.5).to(dtype)
    if gated:
        got = rmsnorm_mod._nvrtc_gated_kernel(x, gate, update, weight, scale, shift, 1e-6)
        ref_x = rmsnorm_mod._gated_residual(x, gate, update)
        ref = (ref_x, rmsnorm_mod._modulate(rmsnorm_mod._rms_norm(ref_x, weight, 1e-6), scale, shift))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    else:
        got = rmsnorm_mod._nvrtc_kernel(x, weight, scale, shift, 1e-6)
        assert torch.equal(got, rmsnorm_mod._modulate(rmsnorm_mod._rms_norm(x, weight, 1e-6), scale, shift))


_FIRST_USE = """
import json, sys, time
t0 = time.perf_counter()
import torch, diffusers_fastpath.ops as ops
from diffusers_fastpath.ops import _build
x = torch.randn(1, 512, 3072, device="cuda", dtype=torch.bfloat16); s = x[:, 0]
t1 = time.perf_counter(); way = _build.load_extension(); out = ops.modulate_scale_shift(x, s, s); torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"way": way, "cold": _build.cold_build, "load_s": _build.load_seconds, "first_call_s": t2 - t1,
                  "import_s": t1 - t0}))
"""


@pytest.mark.gpu
def test_nvrtc_first_use_cold_then_warm(tmp_path):
    env = {**os.environ, "DIFFUSERS_FASTPATH_CACHE": str(tmp_path), _build.ENV_KERNELS: "nvrtc"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _FIRST_USE], env=env, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    (tmp_path / "first_use.json").write_text(json.dumps(runs))
    print("nvrtc first use (cold, warm):", runs)
    assert [r["way"] for r in runs] == ["nvrtc", "nvrtc"] and [r["cold"] for r in runs] == [True, False]


def test_gated_layernorm_scale_rows_launcher_passes_what_bindings_cpp_passes(captured_launches):
    """Qwen-Image 2.1's in-block pair (`gated_layernorm_scale_rows`): layernorm_modulate_rows' launch with the gated
    prologue, its gate an [R, dim] table (chunks of a [B + 1, 2D] modulation: row stride 2D) read at gate_index, the
    scale likewise at index; both outputs allocated, no shift, no affine."""
    gated_rows_mod = importlib.import_module("diffusers_fastpath.ops.gated_layernorm_scale_rows")
    batch, seq, dim = 2, 33, 128
    residual, update = _bf16(batch, seq, dim), _bf16(batch, seq, dim)
    mod = _bf16(batch + 1, 2 * dim)
    gate, scale = mod[:, :dim], mod[:, dim:]
    gate_index = torch.zeros(batch, seq, dtype=torch.int32)
    index = torch.ones(batch, seq, dtype=torch.int32)
    x, out = gated_rows_mod._nvrtc_gated_rows(residual, gate, gate_index, update, scale, None, index, None, None, 1e-6)
    kernel, key, grid, block, a = captured_launches[-1]
    assert (kernel, key) == (layernorm_mod._NVRTC, (torch.bfloat16, torch.bfloat16, 6, True))
    assert (grid, block) == ((batch * seq, 1, 1), (32, 4, 1)) and x.shape == out.shape == residual.shape
    assert (a.a.out, a.a.x, a.a.x_out, a.a.update) == (out.data_ptr(), residual.data_ptr(), x.data_ptr(),
                                                       update.data_ptr())
    assert (a.a.gate, a.a.gate_index, a.a.gate_batch_stride) == (gate.data_ptr(), gate_index.data_ptr(), 2 * dim)
    assert (a.a.scale, a.a.row_index, a.a.scale_seq_stride, a.a.scale_batch_stride) == (
        scale.data_ptr(), index.data_ptr(), 2 * dim, 0)
    assert (a.a.shift, a.a.norm_weight, a.a.norm_bias) == (None, None, None)
    assert (a.a.gated, a.a.modulate_fp32, a.a.affine, a.a.probe, a.a.batch, a.a.seq, a.a.dim) == (
        True, False, False, False, batch, seq, dim)
    # FLUX.1's gated form: no gate index
    layernorm_mod._nvrtc_gated_kernel(residual, gate[:batch, None], update, scale[:batch], scale[:batch], 1e-6)
    assert captured_launches[-1][4].a.gate_index is None
