"""diffusers' ``RMSNorm`` alone, in one pass, bit-identical to its forward::

    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = (x * torch.rsqrt(variance + eps)).to(T) * weight          # T = bf16 or fp16, the weight's dtype
    y = (x * torch.rsqrt(variance + eps)).to(T)                   # a weightless norm (x's dtype T)

seven eager kernels (the fp32 copy, the square, the mean, the add, the rsqrt, the multiply and cast, the weight),
each reading or writing the whole input in fp32, against one that reads it once in T and writes it once. Short rows
are QK norms over each head (SD3 and SD3.5's ``attn.norm_q``, ``norm_k``, ``norm_added_q``, ``norm_added_k``, head_dim
64; head_dim 128; Ideogram 4's 256); wide rows are the pre-norms that no fused chain takes (the generic path's
`FastpathRMSNorm` swap: Cosmos 3's ``input_layernorm`` / ``post_attention_layernorm``, Bria FIBO 2's; LTX-2's
weightless ``norm2``, ``audio_norm2``, ``audio_to_video_norm`` and ``video_to_audio_norm``, four per block).

The kernel is ``csrc/rmsnorm_scale_shift.cu``'s with the ``kPlain`` epilogue. For rows shorter than 128 aten's
reduce kernel does not vectorise its input (Reduce.cuh: ``dim0 >= 128``): each of 32 lanes keeps one accumulator
per element ``l + 32 k`` and combines them in order, then the shuffle-down tree; rows of 128 are the vectorised
order of `rmsnorm_rope_complex`; longer rows (a multiple of 128 with 128 < D < 8192) the vectorised order of the
sandwich norms' `rmsnorm_scale` (the same kernel loop, measured against aten at D = 4096; for D > 128 aten's
setReduceConfig vectorises the input by 4 and gives each row one warp of 32 lanes up to D / 128 < 64 quads per
lane, the same configuration at every such D, so 256 to 512 take that order too, and so do rows of a multiple of 4
that are no multiple of 128: lane l adds quads l, l + 32, ... below D / 4, as aten's vectorised loop does, some
lanes one quad fewer; the fp32 rows of such a D start 16-byte aligned, so aten reads no unaligned head, and with D
% 4 == 0 no tail. Sana's and Sana-Video's norms, 2240 wide, since session 31). aten's per-thread count is
``ceil(D / 32)`` elements (not quads): at 256 (D > 8160) setReduceConfig splits each row across the block's 16 warps
too (`_aten_reduce.set_reduce_config`, block (32, 16)): thread (lane, y) adds quads ``lane + 32 y + 512 k``, the
shuffle-down tree sums each warp, then shared memory sums the 16 warp sums (``block_y_reduce``: warps y + 8 into y,
then y + 4, y + 2, y + 1), the order of the .cu's ``rmsnorm_wide_kernel`` (Ideogram 4's ``llm_cond_norm``, 53248
wide; D = 8188 measured different from the one-warp order on an H100). torch 2.13's Reduce.cuh runs block_x_reduce
before block_y_reduce (pytorch#165178); older builds ran the warp tree first, lane by lane
(`tools/wide_rmsnorm_probe.py` emulates both and says which the build takes). Up to ``ceil(D / 512) < 256`` (D <=
130560) no row splits across blocks; wider ones would (``global_reduce``, a multi-block order this op does not
reproduce). aten's 32-bit indexing is no bound: a larger tensor is split into sub-iterators along its widest output
dim (``with_32bit_indexing``), each row whole in one of them (a row's extent, 4 D bytes, is smaller than any other dim
of size > 1 in a dense layout) and each of thousands of rows (about 2^30 bytes at least), the mean factor taken
before the split, so every row is summed as above (Ideogram 4's full-size ``[1, 18432, 53248]``, 3.9 GB in fp32).
The order is a property of the aten build, so the op verifies itself: the first fast call of each (dtype, D) is
compared with eager by ``torch.equal``; a mismatch disables it for the process with one warning and runs the norm as
written.

``x`` may be any dense layout with unit innermost stride (SD3's processors normalise ``[B, H, S, D]`` views of
``[B, S, H, D]`` projections): the kernel runs over the rows in memory order and the result has ``x``'s strides, as
eager's has. The guard admits D a multiple of 4 from 32 to 130560; at least 16 rows (fewer widen aten's block past a
warp); fp16/bf16 ``x``; diffusers' ``RMSNorm`` or ``FastpathRMSNorm`` with a ``[D]`` weight of x's dtype, or none
(``elementwise_affine=False``: a weight of ones stands in, which rounds nothing), and no bias; no autograd.
"""

from __future__ import annotations

import torch
from diffusers.models.normalization import RMSNorm

from . import _nvrtc
from ._aten_reduce import MAX_THREADS, MAX_VALUES_PER_THREAD
from ._build import LazyLauncher
from ._policy import FusedOp, Site
from .rmsnorm_scale_shift import PLAIN, _Norm, _nvrtc_launch, _rms_norm, norm_reason


def rmsnorm_ref(norm, x: torch.Tensor) -> torch.Tensor:
    """The eager norm: diffusers' ``RMSNorm.forward`` (called as the class's, so that a subclass whose forward runs
    this op falls back to diffusers' code, not to itself)."""
    return RMSNorm.forward(norm, x) if isinstance(norm, RMSNorm) else _rms_norm(x, norm.weight, norm.eps)


def _dense_order(x: torch.Tensor) -> list[int] | None:
    """The permutation that makes `x` contiguous (its dims by decreasing stride, the last one innermost), or None
    where no permutation does."""
    order = sorted(range(x.dim() - 1), key=lambda d: -x.stride(d)) + [x.dim() - 1]
    return order if x.permute(order).is_contiguous() else None


# aten splits a row across the block's 16 warps once ceil(D / 32) reaches 256 values per thread (its
# max_values_per_thread: rmsnorm_wide_kernel from there, rmsnorm_scale_shift._WARP_ROW_WIDEST), and across blocks once
# ceil(D / 512) does (global_reduce: not reproduced)
_WIDEST = MAX_THREADS * (MAX_VALUES_PER_THREAD - 1)  # 130560


def _guard(norm, x: torch.Tensor, check_pointers: bool = True) -> str | None:
    reason = norm_reason(norm, x, weightless=True)
    if reason is not None:
        return reason
    if x.dim() < 2:
        return "shape"
    dim = x.shape[-1]
    if not (dim % 4 == 0 and 32 <= dim <= _WIDEST):
        return "D outside the reproduced reduction"
    rows = x.numel() // dim
    if rows < 16:
        return "fewer than 16 rows"
    if x.stride(-1) != 1 or _dense_order(x) is None:
        return "x not dense"
    weight = norm.weight
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if weight is not None and weight.device != x.device:
        return "devices differ"
    if check_pointers and (x.data_ptr() % 8 or (weight is not None and weight.data_ptr() % 8)):
        return "not 8-byte aligned"
    return None


_UNIT_WEIGHTS: dict[tuple, torch.Tensor] = {}  # (device, dtype, D) -> ones: a weightless norm's weight


def _weight(norm, x: torch.Tensor) -> torch.Tensor:
    """The norm's weight, or for a weightless one (``elementwise_affine=False``: LTX-2's pre-norms) a weight of ones
    in x's dtype: the kernel's ``round_T(round_T(x * rstd) * 1)`` is ``round_T(x * rstd)``, diffusers' weightless
    output, exactly (a value of T times one is that value, rounding nothing). Made once per (device, dtype, D) and
    kept, but made afresh inside a CUDA graph capture (its fill is captured, and runs only when the graph replays)."""
    if norm.weight is not None:
        return norm.weight
    key = (x.device, x.dtype, x.shape[-1])
    ones = _UNIT_WEIGHTS.get(key)
    if ones is None:
        ones = x.new_ones(x.shape[-1])
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            _UNIT_WEIGHTS[key] = ones
    return ones


# The NVRTC way: the shared launcher with the kPlain epilogue (bindings_norms.cpp's rmsnorm_plain: the output
# allocation).
def _nvrtc_kernel(x, weight, eps: float, out=None) -> torch.Tensor:
    out = x.new_empty(x.shape) if out is None else out
    _nvrtc_launch(out, None, x, weight, eps, PLAIN)
    return out


def _raw_guard(x, weight, eps):
    if x.dim() != 3 or x.shape[1] != 1:
        return "shape"
    return _guard(_Norm(weight, eps), x)


_nvrtc.raw_op("_rmsnorm_plain_cuda", "(Tensor x, Tensor weight, float eps) -> Tensor", _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_rmsnorm_plain_cuda")


def _kernel(norm, x: torch.Tensor) -> torch.Tensor:
    order = _dense_order(x)
    xp = x.permute(order)  # contiguous: the rows in memory order
    out = _launch(xp.reshape(-1, 1, x.shape[-1]), _weight(norm, x), norm.eps).view(xp.shape)
    inverse = sorted(range(x.dim()), key=order.__getitem__)
    return out.permute(inverse)  # x's strides, as eager's result has


@torch.library.custom_op("diffusers_fastpath::rmsnorm", mutates_args=())
def _rmsnorm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _guard(norm, x) is None:
        return _kernel(norm, x)
    return _rms_norm(x, weight, eps).clone()


@_rmsnorm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)  # dense x: its strides, as the kernel's and eager's results have


RMSNORM = FusedOp(
    "rmsnorm",
    ref=rmsnorm_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=lambda norm, x: torch.ops.diffusers_fastpath.rmsnorm.default(x, norm.weight, norm.eps),
    verify_key=lambda norm, x: (str(x.dtype).removeprefix("torch."), x.shape[-1]),
    # no `modules`: this op is the norm's forward itself (`FastpathRMSNorm`), reached through the module's call, so
    # its hooks have run; refusing for them would only cost the kernel
)


def rmsnorm(norm, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``norm(x)`` for a diffusers ``RMSNorm`` (a QK norm over each head, or a wide pre-norm), fused on CUDA
    (self-verified) and bit-identical to eager everywhere.

    Args:
        norm: a diffusers ``RMSNorm`` (a weight or none, no bias), e.g. SD3's ``attn.norm_q``, LTX-2's ``norm2``.
        x: ``[..., D]`` q or k, any dense layout with unit innermost stride (the result has its strides).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers.models.normalization import RMSNorm
        >>> from diffusers_fastpath.ops import rmsnorm, rmsnorm_ref
        >>> norm, x = RMSNorm(64, eps=1e-6), torch.randn(1, 2, 16, 64)
        >>> torch.equal(rmsnorm(norm, x), rmsnorm_ref(norm, x))
        True
    """
    return RMSNORM(site, norm, x)
