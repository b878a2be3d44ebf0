"""``torch.nn.GroupNorm`` (weight and bias) over ``[N, C, *]`` activations, optionally followed by SiLU, in two
kernels that use the whole GPU, bit-identical to eager (the VAE's norms: ``ResnetBlock2D``'s ``norm1 -> nonlinearity``
and ``norm2 -> nonlinearity``, the decoder's and encoder's ``conv_norm_out -> conv_act``, the mid-block attention's
``group_norm``).

Eager on CUDA (T = bf16 or fp16, fp32 arithmetic, ``round`` to nearest even in T; ``csrc/group_norm_silu.cu`` spells
out aten's kernels)::

    mean, rstd = Welford statistics of each (n, g) row           # RowwiseMomentsCUDAKernel: ONE block per row
    a = rstd * gamma[c]; b = -a * mean + beta[c]                  # ComputeFusedParamsCUDAKernel (not an FMA)
    y = round(fma(a, x, b))                                       # the elementwise kernel
    out = round(y / (1 + exp(-y)))                                # F.silu, when the module after the norm is SiLU

The statistics kernel is what a VAE decode waits on: 46.0 of the 87.2 ms of a FLUX.1 decode at 1024x1024 on the
H200 (DESIGN.md), because a GroupNorm of 32 groups gives aten 32 blocks for a 132-multiprocessor GPU and each
thread's Welford chain over its strided slice of the row (up to 16384 elements at 256 channels x 1024^2) runs
behind one outstanding load. Here each aten thread's chain is kept as it is (serial, in aten's element order, with
its division and its FMA), and so is the combine tree (the warp's shuffle tree, then BlockReduce's second level over
the 16 warps, lanes 16..31 the identity), but the chains of a row run in 16 one-warp blocks spread over the GPU with
64 loads in flight per thread, and the chain's division runs as a branch-free, correctly rounded sequence (the same
quotient as div.rn, whose range check would end a basic block at every element; the kernel's file proves it); the
second kernel finishes each row's statistics and writes the normalised (+ SiLU) output in 16-byte vectors.

Which aten it matches: torch 2.11 rounds the statistics to T between the two kernels (``T* mean, T* rstd``); a later
change (pytorch#183946) keeps them in fp32. The op asks the GPU once per (device, dtype): its kernel in both modes on
a small random input against ``F.group_norm`` (`_platform_variant`). Whatever is chosen, the op verifies itself like
the LayerNorm: the first fast call of each signature (dtype, C, groups, aten's block of 32 or 512 threads) is
compared with eager by ``torch.equal``; a mismatch disables it for the process with one warning. The SiLU (aten's
``x / (1 + expf(-x))``) is proven on all 65536 values of the dtype once (the kernel's identity-affine probe mode).

Measured on the H200 (torch 2.11, bf16, 533694c; the kernels level, 40 calls replayed as a CUDA graph): at FLUX.1's
decode shapes 6.7x (512 x 128^2: 256 -> 38.5 us) to 8.0x (256 x 1024^2: 7730 -> 968 us) faster than eager's GroupNorm
+ SiLU, at 38-62% of the copy bandwidth counting x read twice and the output written once; per FLUX.1 decode at
1024x1024 the 30 calls take 7.0 ms of kernels (statistics 4.1, output 2.9) against eager's 52.5 (RowwiseMoments 45.9,
params and output 4.7, SiLU 1.9). The statistics kernel is bound by its chains' latency: the plain GroupNorm at
256 x 1024^2 took 0.85 ms; with div.rn in the chain and 32 loads ahead (the probe's statistics kernel) 1.58 ms; the
first version (div.rn, run-time strides: a basic block per element) 2.98 ms.

What the guard admits: a module of exactly ``nn.GroupNorm`` (or this package's subclass of it) with weight and bias of
x's dtype, fp16/bf16 x of shape ``[N, C, *]`` with HxW (the product of the trailing sizes) > 1 (HxW == 1 is aten's
other expression) and a multiple of 8 (a 16-byte vector stays in one channel), at most 65535 rows (N * groups), no
autograd; any layout (a non-contiguous x is made contiguous first, as aten's ``group_norm`` does on CUDA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher, load_extension
from ._policy import (HALF_DTYPES, REASON_FORWARD_REPLACED, FusedOp, Site, autograd_device_reason, bits,
                      forward_replaced)

_VEC_BYTES = 16
_ATEN_BLOCK = 512  # cuda_utils::kCUDABlockReduceNumThreads: aten's block for rows of at least 512 elements
_WARP = 32
_MAX_ROWS = 65535  # the apply kernel's grid.y
# csrc/group_norm_silu.cu's variant bits (tests/test_group_norm_silu.py reads them from the .cu)
STATS_IN_FLOAT = 8
PARAMS_FUSED = 16
IDENTITY_AFFINE = 64
DIV_RN = 128
_STATS_BITS = 135  # the bits that select the statistics kernel's probe instantiation
_VARIANT_MASK = 255
_APPLY_THREADS, _APPLY_BLOCKS_PER_SM = 256, 8

PLAIN_GROUP_NORMS: tuple[type, ...] = (nn.GroupNorm,)  # + the models' subclass whose forward runs this op (add_plain)


def add_plain(cls: type) -> None:
    """Let the guard take modules of `cls`, a subclass of ``nn.GroupNorm`` that adds no state and computes what
    ``nn.GroupNorm.forward`` does (the VAE adapters' `FastpathGroupNorm`)."""
    global PLAIN_GROUP_NORMS
    if cls not in PLAIN_GROUP_NORMS:
        PLAIN_GROUP_NORMS = (*PLAIN_GROUP_NORMS, cls)


def group_norm_ref(norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """The eager norm: ``nn.GroupNorm.forward`` (the class's, so that a subclass whose forward runs this op falls back
    to torch's code, not to itself)."""
    return nn.GroupNorm.forward(norm, x)


def group_norm_silu_ref(norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """The eager pair: the norm, then ``F.silu`` (an ``nn.SiLU`` module's forward)."""
    return F.silu(group_norm_ref(norm, x))


def kernel_eps(eps: float, dtype: torch.dtype) -> float:
    """The eps aten's statistics kernel adds: ``static_cast<T>(eps)`` (a double, to float, to T), read back as fp32."""
    return torch.tensor(eps, dtype=torch.float32).to(dtype).item()


def aten_threads(row_size: int) -> int:
    """RowwiseMomentsCUDAKernel's block for a row of `row_size` elements: one warp below 512, else 512 threads."""
    return _WARP if row_size < _ATEN_BLOCK else _ATEN_BLOCK


def _tensors_guard(x: torch.Tensor, weight, bias, groups: int, check_pointers: bool = True) -> str | None:
    dtype = x.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if weight is None or bias is None:
        return "no affine"
    if weight.dtype is not dtype or bias.dtype is not dtype:
        return "weight or bias of another dtype"
    if x.dim() < 3:
        return "x not [N, C, *]"
    batch, channels = x.shape[:2]
    if groups <= 0 or channels % groups or weight.shape != (channels,) or bias.shape != (channels,):
        return "shape"
    hxw = math.prod(x.shape[2:])
    if hxw <= 1:
        return "HxW of 1 (aten's other expression)"
    vec = _VEC_BYTES // x.element_size()
    if hxw % vec:
        return f"HxW not a multiple of {vec}"
    if batch * groups > _MAX_ROWS:
        return f"more than {_MAX_ROWS} rows"
    if channels // groups * hxw >= 2**31:
        return "rows too long"
    reason = autograd_device_reason(x, weight, bias)
    if reason is not None:
        return reason
    if check_pointers and x.is_contiguous() and x.data_ptr() % _VEC_BYTES:
        return "not 16-byte aligned"
    return None


def _guard(norm, x: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernels take these inputs, else the reason they do not (counted at the call site)."""
    if type(norm) not in PLAIN_GROUP_NORMS:
        return f"{type(norm).__name__} is not a plain nn.GroupNorm"
    if forward_replaced(norm):  # (nn.GroupNorm.forward replaced on the class: the kernel would skip it)
        return REASON_FORWARD_REPLACED.format(type(norm).__name__)
    if not isinstance(x, torch.Tensor):
        return "input not a tensor"
    return _tensors_guard(x, norm.weight, norm.bias, norm.num_groups, check_pointers)


# The NVRTC way (ops/_nvrtc.py): csrc/group_norm_silu.cu's two kernels, launched as its launch() and bindings.cpp's
# group_norm_silu do. Duplicated from there: the GroupNormSiluArgs fields (fastpath.h), the workspace and output
# allocation, aten_threads, the statistics grid (one one-warp block per aten warp of each row) and the apply grid
# (_apply_blocks_per_row, apply_blocks_per_row's twin); the guard stands for bindings.cpp's input checks.
_ARGS = _nvrtc.Params("GroupNormSiluArgs", ("out", "P"), ("x", "P"), ("gamma", "P"), ("beta", "P"), ("partial", "P"),
                      ("batch", "q"), ("channels", "q"), ("groups", "q"), ("hxw", "q"), ("row_size", "q"),
                      ("eps", "f"), ("threads", "i"), ("variant", "i"), ("silu", "?"), ("dtype", "i"),
                      ("channels_last", "?"))
_STATS = _nvrtc.Kernel(
    "group_norm_silu.cu", "diffusers_fastpath::group_norm_stats_kernel",
    {(dtype, probe, threads): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(probe).lower()}, {threads}" for dtype in HALF_DTYPES
     for probe in (False, True) for threads in (_WARP, _ATEN_BLOCK)},
    _nvrtc.Params("group_norm_stats_kernel", ("a", _ARGS)),
)
_APPLY = _nvrtc.Kernel(
    "group_norm_silu.cu", "diffusers_fastpath::group_norm_apply_kernel",
    {(dtype, silu): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(silu).lower()}" for dtype in HALF_DTYPES
     for silu in (False, True)},
    _nvrtc.Params("group_norm_apply_kernel", ("a", _ARGS)),
)


_APPLY_CL = _nvrtc.Kernel(
    "group_norm_silu.cu", "diffusers_fastpath::group_norm_apply_cl_kernel",
    {(dtype, silu): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(silu).lower()}" for dtype in HALF_DTYPES
     for silu in (False, True)},
    _nvrtc.Params("group_norm_apply_cl_kernel", ("a", _ARGS)),
)
_CL_CHANNELS, _CL_POSITIONS, _CL_THREADS, _CL_BLOCKS_PER_SM = 64, 64, 256, 16


def _cl_grid(batch: int, channels: int, hxw: int, sms: int) -> tuple[int, int, int]:
    """csrc/group_norm_silu.cu's apply_cl_grid, line for line."""
    tiles = -(-hxw // _CL_POSITIONS)
    channel_tiles = -(-channels // _CL_CHANNELS)
    x = (sms * _CL_BLOCKS_PER_SM + channel_tiles * batch - 1) // (channel_tiles * batch)
    return max(1, min(x, tiles)), channel_tiles, batch


def _apply_blocks_per_row(rows: int, vecs_per_row: int, sms: int) -> int:
    """csrc/group_norm_silu.cu's apply_blocks_per_row, line for line."""
    needed = (vecs_per_row + _APPLY_THREADS - 1) // _APPLY_THREADS
    per_row = (sms * _APPLY_BLOCKS_PER_SM + rows - 1) // rows
    return max(1, min(per_row, needed))


def _nvrtc_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float, silu: bool,
                  variant: int, out: torch.Tensor | None = None, channels_last: bool = False) -> torch.Tensor:
    if variant & ~_VARIANT_MASK:
        raise ValueError(f"group_norm_silu: no variant {variant}")
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    batch, channels = x.shape[:2]
    hxw = math.prod(x.shape[2:])
    row_size = channels // groups * hxw
    rows, threads = batch * groups, aten_threads(row_size)
    if channels_last:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    elif out is None:
        out = x.new_empty(x.shape)
    else:
        _nvrtc.check_out("group_norm_silu", out, x.shape, x, _VEC_BYTES)
    partial = x.new_empty((rows * (threads // _WARP) * 3,), dtype=torch.float32)
    device = x.device.index
    args = (out.data_ptr(), x.data_ptr(), weight.data_ptr(), bias.data_ptr(), partial.data_ptr(), batch, channels,
            groups, hxw, row_size, kernel_eps(eps, x.dtype), threads, variant, silu, _nvrtc.DTYPE_CODE[x.dtype],
            channels_last)
    _STATS.launch(device, (x.dtype, bool(variant & _STATS_BITS), threads), (rows * (threads // _WARP), 1, 1),
                  (_WARP, 1, 1), *args)
    if channels_last:
        grid = _cl_grid(batch, channels, hxw, _nvrtc.num_sms(device))
        _APPLY_CL.launch(device, (x.dtype, bool(silu)), grid, (_CL_THREADS, 1, 1), *args)
        return out
    vecs = row_size * x.element_size() // _VEC_BYTES
    grid = (_apply_blocks_per_row(rows, vecs, _nvrtc.num_sms(device)), rows, 1)
    _APPLY.launch(device, (x.dtype, bool(silu)), grid, (_APPLY_THREADS, 1, 1), *args)
    return out


def _nvrtc_cl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float, silu: bool,
              variant: int) -> torch.Tensor:
    return _nvrtc_kernel(x, weight, bias, groups, eps, silu, variant, channels_last=True)


def _raw_guard(x, weight, bias, groups, eps, silu, variant):
    return _tensors_guard(x, weight, bias, groups)


def _raw_cl_guard(x, weight, bias, groups, eps, silu, variant):
    if x.dim() != 4 or x.shape[1] % 8:
        return "x not 4-D with channels a multiple of 8"
    return _tensors_guard(x, weight, bias, groups)


_nvrtc.raw_op("_group_norm_silu_cuda",
              "(Tensor x, Tensor weight, Tensor bias, int groups, float eps, bool silu, int variant) -> Tensor",
              _raw_guard, _nvrtc_kernel)
_nvrtc.raw_op("_group_norm_silu_cuda_out", "(Tensor(a!) out, Tensor x, Tensor weight, Tensor bias, int groups, "
              "float eps, bool silu, int variant) -> ()", _raw_guard, _nvrtc_kernel, outs=1)

_nvrtc.raw_op("_group_norm_silu_cl_cuda",
              "(Tensor x, Tensor weight, Tensor bias, int groups, float eps, bool silu, int variant) -> Tensor",
              _raw_cl_guard, _nvrtc_cl)

_raw = LazyLauncher(_nvrtc_kernel, "_group_norm_silu_cuda")  # (x, weight, bias, groups, eps, silu, variant)
# the same, its output channels-last (a 4-D x): `group_norm_silu_conv`'s
raw_channels_last = LazyLauncher(_nvrtc_cl, "_group_norm_silu_cl_cuda")
_PLATFORM_VARIANT: dict = {}  # (device, dtype) -> the variant bits of the aten this process runs (`_platform_variant`)


def _platform_variant(device: torch.device, dtype: torch.dtype) -> int:
    """Which aten this process runs, asked once per (device, dtype): 0 where aten rounds the statistics to T between
    its kernels (torch 2.11), `STATS_IN_FLOAT` where it keeps them in fp32 (pytorch#183946). Both modes of the kernel
    run on a small random input (2 x 64 x 32 x 32, 32 groups: rows of 2048, aten's 512-thread block) against
    ``F.group_norm``; the first that is equal wins (0 if neither is: the op's own check then disables it, saying so)."""
    key = (device, dtype)
    variant = _PLATFORM_VARIANT.get(key)
    if variant is None:
        gen = torch.Generator(device=device).manual_seed(0)
        x = (torch.randn(2, 64, 32, 32, generator=gen, device=device) * 3 + 1).to(dtype)
        weight = torch.randn(64, generator=gen, device=device).to(dtype)
        bias = torch.randn(64, generator=gen, device=device).to(dtype)
        eager = F.group_norm(x, 32, weight, bias, 1e-6)
        matches = (v for v in (0, STATS_IN_FLOAT) if torch.equal(_raw(x, weight, bias, 32, 1e-6, False, v), eager))
        variant = next(matches, 0)
        _PLATFORM_VARIANT[key] = variant
    return variant


def _kernel(norm, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
    variant = _platform_variant(x.device, x.dtype)
    return _raw(x, norm.weight, norm.bias, norm.num_groups, norm.eps, silu, variant)


def _kernel_silu(norm, x: torch.Tensor) -> torch.Tensor:
    return _kernel(norm, x, True)


def _signature(norm, x: torch.Tensor):
    """What one ``torch.equal`` check vouches for: dtype, channels, groups and aten's block (32 or 512 threads)."""
    row_size = x.shape[1] // norm.num_groups * math.prod(x.shape[2:])
    return (str(x.dtype).removeprefix("torch."), x.shape[1], norm.num_groups, aten_threads(row_size))


def every_value(dtype: torch.dtype, device) -> torch.Tensor:
    """All 65536 fp16/bf16 bit patterns (NaNs and infinities included) as one ``[1, 8, 8192]`` tensor."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device=device).to(torch.int16)
    return patterns.view(dtype).view(1, 8, 8192)


def _prove_silu(norm, x: torch.Tensor) -> bool:
    """The kernel's SiLU equals eager's on every value of the dtype: the apply kernel's identity-affine probe mode
    (``y = fma(1, x, -0) = x``) over all 65536 bit patterns, against ``F.silu``."""
    values = every_value(x.dtype, x.device)
    ones = torch.ones(8, dtype=x.dtype, device=x.device)
    out = _raw(values, ones, ones, 8, 1e-6, True, IDENTITY_AFFINE | _platform_variant(x.device, x.dtype))
    return torch.equal(bits(out), bits(F.silu(values)))


@torch.library.custom_op("diffusers_fastpath::group_norm_silu", mutates_args=())
def _group_norm_silu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                        silu: bool) -> torch.Tensor:
    # What torch.compile runs: the kernels where the guard (with real pointers) allows, the eager chain elsewhere.
    # torch.compile emits this op only for signatures already verified (see FusedOp).
    if _tensors_guard(x, weight, bias, groups) is None:
        load_extension()
        return _raw(x, weight, bias, groups, eps, silu, _platform_variant(x.device, x.dtype))
    y = F.group_norm(x, groups, weight, bias, eps)
    return (F.silu(y) if silu else y).contiguous()


@_group_norm_silu_op.register_fake
def _(x, weight, bias, groups, eps, silu):
    torch._check(x.dim() >= 3, lambda: f"group_norm_silu: x must be [N, C, *], got {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _custom(silu: bool):
    return lambda norm, x: torch.ops.diffusers_fastpath.group_norm_silu.default(
        x, norm.weight, norm.bias, norm.num_groups, norm.eps, silu)


GROUP_NORM = FusedOp("group_norm", ref=group_norm_ref, guard=_guard, kernel=_kernel, custom_op=_custom(False),
                     verify_key=_signature)
GROUP_NORM_SILU = FusedOp("group_norm_silu", ref=group_norm_silu_ref, guard=_guard, kernel=_kernel_silu,
                          custom_op=_custom(True), verify_key=_signature, prove=_prove_silu)


def group_norm(norm: nn.GroupNorm, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``norm(x)`` for an ``nn.GroupNorm`` with weight and bias, on CUDA with the statistics spread over the whole
    GPU (self-verified), bit-identical to eager everywhere.

    Args:
        norm: the ``nn.GroupNorm`` (affine) of the site; it runs itself (``nn.GroupNorm.forward``) on fallback.
        x: ``[N, C, *]`` activations (the VAE's ``[N, C, H, W]``, ``[N, C, T, H, W]`` or the attention's ``[N, C, L]``).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import group_norm, group_norm_ref
        >>> norm, x = torch.nn.GroupNorm(4, 16), torch.randn(1, 16, 8, 8)
        >>> torch.equal(group_norm(norm, x), group_norm_ref(norm, x))
        True
    """
    return GROUP_NORM(site, norm, x)


def group_norm_silu(norm: nn.GroupNorm, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``F.silu(norm(x))`` (a GroupNorm and the ``nn.SiLU`` module after it, each rounded to x's dtype as eager
    rounds them) in one pass, bit-identical to eager everywhere; as `group_norm`, with the SiLU in the output pass.

    Args:
        norm: the ``nn.GroupNorm`` (affine) of the site.
        x: ``[N, C, *]`` activations.
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import group_norm_silu, group_norm_silu_ref
        >>> norm, x = torch.nn.GroupNorm(4, 16), torch.randn(1, 16, 8, 8)
        >>> torch.equal(group_norm_silu(norm, x), group_norm_silu_ref(norm, x))
        True
    """
    return GROUP_NORM_SILU(site, norm, x)
