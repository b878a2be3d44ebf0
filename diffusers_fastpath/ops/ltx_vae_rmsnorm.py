"""LTX-Video's VAE norm (diffusers' ``RMSNorm`` without weight, called on the channel-last view ``x.movedim(1, -1)``
of a channel-first ``[B, C, T, H, W]`` activation: ``norm1`` / ``norm2`` of every ``LTXVideoResnetBlock3d``, the
encoder's and the decoder's ``norm_out``), optionally followed by the SiLU after it (the resnets' ``nonlinearity``, the
``conv_act`` after ``norm_out``: the pair `ltx_vae_rmsnorm_silu`), with everything after aten's reduction in one pass,
bit-identical to eager.

The module computes, for bf16/fp16 x (T its dtype) of ``[B, *, C]`` whose memory is channel first::

    v   = x.to(torch.float32).pow(2).mean(-1, keepdim=True)   # aten's reduction, kept as eager runs it
    r   = torch.rsqrt(v + eps)                                 # aten, kept (1/C of x's size)
    y   = round(float(x) * r)                                  # the mixed-dtype multiply, then ``.to(T)``
    out = round(y / (1 + exp(-y)))                             # the pair: the SiLU module after it, aten's silu_kernel

Eager writes the fp32 product and reads it back for the cast; ``csrc/ltx_vae_rmsnorm.cu`` reads x once and writes
the result once. Where x is dense (the resnets' inputs) the kernel also writes the reduction's input, the fp32
``x.to(float32).pow(2)`` (one pass instead of eager's copy and square: aten's pow by 2 is ``x * x``, and the square
of a bf16/fp16 value is exact in fp32), in eager's layout, for aten's mean. The reduction and the rsqrt are aten's
own calls on tensors of the same values, shapes and strides (the same kernels, so the same bits); the multiply is
one IEEE product rounded where eager's cast rounds, so the norm is exact by construction.
Still, the first call of each signature (dtype) is compared with eager (`verify_key`): the kernel is new on every
GPU it meets; a mismatch disables the op for the process (one warning) and eager runs.

The pair (the module call ``norm(x.movedim(1, -1)).movedim(-1, 1)``, then the ``nn.SiLU`` module on it: eager rounds
the norm's output to T and aten's silu computes in fp32 from it and rounds) applies ``csrc/elementwise.cuh``'s
``silu`` to the rounded y in the same pass: one read of x, one write, where eager also writes y and reads it back.
The SiLU is a function of the one T value y, so it is proven on every value of the dtype on the device before the op
is trusted (`_unary_proof`, the kernel's probe mode: all 65536 bf16 / fp16 values on the first call of a signature,
beside the first-call comparison); a failed proof disables the pair for the process and eager runs. The pair stands
for the norm's call: hooks on the norm refuse it (``modules``; the SiLU module's are the caller's to check, as
`diffusers_fastpath.models.vae.PairCalls` does), and its fallback calls the module, so they run.

What the guard admits: a module whose exact class the VAE adapter registered (`add_norm_class`: diffusers'
``RMSNorm`` after its ``forward`` was checked by source digest, or this package's subclass of it) without weight
(``elementwise_affine=False``, as LTX's VAE builds them); a bf16/fp16 x of at least 3 dims whose ``movedim(-1, 1)``
has each channel's elements contiguous (channel-first memory, possibly with a gap between channels: an upsampler's
output with its first frames sliced off), a multiple of 8 elements per channel and 8-element aligned channel and
batch strides; no autograd; on CUDA, 16-byte aligned. The result is contiguous channel-first memory, as eager's is
(the SiLU's too). The pair's guard is the norm's. Anything else runs the module's forward as diffusers wrote it (the
pair: the module's call, then ``F.silu``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, EagerClasses, FusedOp, Site, tensor_reason
from ._unary_proof import mismatches
from .gelu_cat import every_value

_VEC_BYTES = 16
_THREADS, _BLOCKS_PER_SM = 256, 8  # csrc/ltx_vae_rmsnorm.cu's kThreads, kBlocksPerSm

_BASES = EagerClasses()  # the classes the op takes, each with the diffusers class whose forward is the eager one


def add_norm_class(cls: type, base: type | None = None) -> None:
    """Let the guard take modules of `cls`: diffusers' ``RMSNorm`` (`base` None) once its ``forward`` was checked to
    be the norm documented above, or this package's subclass of `base` that adds no state and runs this op."""
    _BASES.add(cls, base)


def ltx_rmsnorm_ref(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The eager norm: the diffusers class's ``forward`` (so that this package's subclass falls back to diffusers'
    code, not to itself)."""
    return _BASES.eager(norm).forward(norm, x)


def ltx_vae_rmsnorm_silu_ref(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The eager pair: the norm (`ltx_rmsnorm_ref`), then ``F.silu`` (an ``nn.SiLU`` module's forward)."""
    return F.silu(ltx_rmsnorm_ref(norm, x))


def _pair_fallback(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the pair runs where the kernel does not: the norm module's call (its hooks run), then ``F.silu``."""
    return F.silu(norm(x))


def _guard(norm, x: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    reason = _BASES.refusal(norm, "RMS norm")
    if reason is not None:
        return reason
    if getattr(norm, "weight", 0) is not None or getattr(norm, "bias", None) is not None:
        return "norm with weight or bias"
    if not isinstance(getattr(norm, "eps", None), float):
        return "eps not a python float"
    reason = tensor_reason(x, HALF_DTYPES, 3, "[B, *, C]")
    if reason is not None:
        return reason
    strides = channel_strides(x.movedim(-1, 1))
    if strides is None:
        return "x not the channel-last view of channel-first memory"
    vec = _VEC_BYTES // x.element_size()
    if math.prod(x.shape[1:-1]) % vec or x.numel() == 0:
        return f"trailing sizes not a multiple of {vec} elements"
    if strides[0] % vec or strides[1] % vec:
        return f"strides not multiples of {vec} elements"
    if torch.is_grad_enabled() and x.requires_grad:
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if check_pointers and x.data_ptr() % _VEC_BYTES:
        return "not 16-byte aligned"
    return None


def channel_strides(xc: torch.Tensor) -> tuple[int, int] | None:
    """``(batch stride, channel stride)`` of a channel-first ``[B, C, *]`` tensor whose channels each hold their
    elements contiguously (what the kernel reads), else ``None``."""
    expected = 1
    for d in range(xc.dim() - 1, 1, -1):
        if xc.shape[d] != 1 and xc.stride(d) != expected:
            return None
        expected *= xc.shape[d]
    if xc.shape[1] > 1 and xc.stride(1) < expected:
        return None
    return xc.stride(0), xc.stride(1)


def reciprocal(x: torch.Tensor, eps: float, square=None) -> torch.Tensor:
    """What eager multiplies by: ``torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)`` (the same
    aten calls on the same view); with `square` (the kernel's square mode, taking x's channel-first memory) the
    squares come from it where x is dense, in the layout eager's ``.to(float32)`` keeps (x's)."""
    if square is not None and x.movedim(-1, 1).is_contiguous():
        sq = square(x.movedim(-1, 1)).movedim(1, -1)
    else:
        sq = x.to(torch.float32).pow(2)
    return torch.rsqrt(sq.mean(-1, keepdim=True) + eps)


def square_arithmetic(xc: torch.Tensor) -> torch.Tensor:
    """The kernel's square mode in torch: fp32 ``x * x`` of the channel-first ``[B, C, *]`` x, contiguous."""
    f = xc.float()
    return (f * f).contiguous()


def ltx_rmsnorm_arithmetic(x: torch.Tensor, r: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """The kernel's arithmetic in torch (the fp32 product, rounded to x's dtype; with `silu` aten's SiLU of that, which
    computes in fp32 and rounds): what the tests' emulated kernels run on a CPU, and the documentation of
    ``csrc/ltx_vae_rmsnorm.cu`` in code."""
    y = (x.float() * r).to(x.dtype)
    return F.silu(y) if silu else y


def launch_arithmetic(x: torch.Tensor, r, square: bool, silu: bool, probe: bool) -> torch.Tensor:
    """The kernel launch (`_launch`'s arguments: x's channel-first memory ``[B, C, *]``, r ``[B, *]``-sized fp32) as
    torch code of the kernel's arithmetic, its result contiguous as the kernel's: the tests' emulated kernel."""
    if square:
        return square_arithmetic(x)
    if probe:
        return F.silu(x).contiguous()
    return ltx_rmsnorm_arithmetic(x, r.reshape(x.shape[0], 1, *x.shape[2:]), silu).contiguous()


# The NVRTC way (ops/_nvrtc.py): csrc/ltx_vae_rmsnorm.cu's kernel, launched as its launch() and bindings.cpp's
# ltx_rmsnorm do: the LtxRmsNormArgs fields (fastpath.h), the output allocation and the grid (one thread per vector,
# at most kBlocksPerSm blocks per SM); the guard stands for bindings.cpp's checks.
_ARGS = _nvrtc.Params("LtxRmsNormArgs", ("out", "P"), ("x", "P"), ("rsqrt", "P"), ("batch", "q"), ("channels", "q"),
                      ("spatial", "q"), ("x_batch_stride", "q"), ("x_channel_stride", "q"), ("square", "i"),
                      ("silu", "i"), ("probe", "i"), ("dtype", "i"))
_NVRTC = _nvrtc.Kernel("ltx_vae_rmsnorm.cu", "diffusers_fastpath::ltx_rmsnorm_kernel",
                       {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
                       _nvrtc.Params("ltx_rmsnorm_kernel", ("a", _ARGS)))


def _raw_guard(x, rsqrt, square, silu, probe):
    batch, channels = (x.shape[0], x.shape[1]) if x.dim() >= 3 else (0, 0)
    spatial = x.numel() // max(1, batch * channels)
    vec = _VEC_BYTES // x.element_size() if x.dtype in HALF_DTYPES else 1
    strides = channel_strides(x) if x.dim() >= 3 else None
    if x.dtype not in HALF_DTYPES or strides is None or spatial % vec or strides[0] % vec or strides[1] % vec:
        return "x"
    if int(square) + int(silu) + int(probe) > 1:
        return "mode"
    rows = not (square or probe)  # (the modes that read the reciprocal)
    if rows and (rsqrt is None or rsqrt.dtype != torch.float32 or not rsqrt.is_contiguous()
                 or rsqrt.numel() != batch * spatial):
        return "rsqrt"
    if not x.is_cuda or (rows and rsqrt.device != x.device):
        return "device"
    if x.data_ptr() % _VEC_BYTES or (rows and rsqrt.data_ptr() % _VEC_BYTES):
        return "not 16-byte aligned"
    return None


def _nvrtc_kernel(x, rsqrt, square, silu, probe):
    batch, channels = x.shape[:2]
    spatial = x.numel() // max(1, batch * channels)
    out = torch.empty(x.shape, dtype=torch.float32 if square else x.dtype, device=x.device)
    vecs = x.numel() * x.element_size() // _VEC_BYTES
    if vecs == 0:
        return out
    device = x.device.index
    blocks = _nvrtc.grid_stride_blocks(device, vecs, _THREADS, _BLOCKS_PER_SM)
    _NVRTC.launch(device, x.dtype, (blocks, 1, 1), (_THREADS, 1, 1), out.data_ptr(), x.data_ptr(),
                  0 if square or probe else rsqrt.data_ptr(), batch, channels, spatial, x.stride(0), x.stride(1),
                  int(square), int(silu), int(probe), _nvrtc.DTYPE_CODE[x.dtype])
    return out


_nvrtc.raw_op("_ltx_rmsnorm_cuda", "(Tensor x, Tensor? rsqrt, bool square, bool silu, bool probe) -> Tensor",
              _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_ltx_rmsnorm_cuda")  # (x, rsqrt, square, silu, probe)


def _square(xc: torch.Tensor) -> torch.Tensor:
    return _launch(xc, None, True, False, False)


def silu_probe(row: torch.Tensor) -> torch.Tensor:
    """The kernel's probe mode (``round(silu(x))``) on a ``[1, 1, n]`` row, for `_unary_proof.mismatches`: the kernel
    runs 16-byte vectors only, so a row of no multiple of the vector (mismatches' second row) is padded with zeros to
    one and the padding's results dropped."""
    pad = -row.shape[-1] % (_VEC_BYTES // row.element_size())
    padded = torch.cat([row, row.new_zeros(*row.shape[:-1], pad)], dim=-1) if pad else row
    return _launch(padded, None, False, False, True)[..., :row.shape[-1]]


def _fused(x: torch.Tensor, eps: float, silu: bool = False) -> torch.Tensor:
    """The kernel over x's channel-first memory as ``[B, C, spatial]`` (channels possibly apart), the result as
    eager's is (the channel-last view of contiguous channel-first memory; eager's SiLU of it keeps that layout). The
    reciprocal is aten's, on x as eager takes it (``[B, *, 1]`` contiguous: one value per batch and position, the
    kernel's ``[B, spatial]``), its squares the kernel's where x is dense."""
    r = reciprocal(x, eps, _square).contiguous()
    out = _launch(x.movedim(-1, 1), r, False, silu, False)
    return out.movedim(1, -1)


def _kernel(norm, x: torch.Tensor) -> torch.Tensor:
    return _fused(x, norm.eps)


def _kernel_silu(norm, x: torch.Tensor) -> torch.Tensor:
    return _fused(x, norm.eps, True)


def _signature(norm, x: torch.Tensor):
    """What one first-call ``torch.equal`` vouches for: the dtype and whether x is dense (the kernel then writes the
    squares too) or has its channels apart (the op is exact by construction; the check is its second line, the
    kernel being new on each GPU kind it meets)."""
    return (str(x.dtype).removeprefix("torch."), "dense" if x.movedim(-1, 1).is_contiguous() else "strided")


def _prove_silu(norm, x: torch.Tensor) -> bool:
    """The kernel's SiLU (its probe mode) equals eager's ``F.silu`` on every value of x's dtype (all 65536 bf16 / fp16
    bit patterns, NaNs with their payloads, infinities and subnormals), on x's device."""
    return int(mismatches(every_value(x.dtype, x.device).flatten(), silu_probe)) == 0


@torch.library.custom_op("diffusers_fastpath::ltx_rmsnorm", mutates_args=())
def _ltx_rmsnorm_op(x: torch.Tensor, eps: float, silu: bool = False) -> torch.Tensor:
    # What torch.compile runs: the kernel (the caller's guard admitted these inputs; torch.compile emits this op only
    # for signatures already verified, and for the pair proven, see FusedOp); the arithmetic elsewhere.
    if x.is_cuda:
        return _fused(x, eps, silu)
    return ltx_rmsnorm_arithmetic(x, reciprocal(x, eps), silu)


@_ltx_rmsnorm_op.register_fake
def _(x, eps, silu=False):
    torch._check(x.dim() >= 3, lambda: f"ltx_rmsnorm: x must be [B, *, C], got {tuple(x.shape)}")
    # eager's layout: the channel-last view of contiguous channel-first memory (x's channels may lie apart)
    return torch.empty_like(x.movedim(-1, 1), memory_format=torch.contiguous_format).movedim(1, -1)


def _custom(silu: bool):
    def call(norm, x):
        return torch.ops.diffusers_fastpath.ltx_rmsnorm.default(x, float(norm.eps), silu)
    return call


LTX_RMSNORM = FusedOp("ltx_rmsnorm", ref=ltx_rmsnorm_ref, guard=_guard, kernel=_kernel, custom_op=_custom(False),
                      verify_key=_signature)
LTX_VAE_RMSNORM_SILU = FusedOp("ltx_vae_rmsnorm_silu", ref=ltx_vae_rmsnorm_silu_ref, guard=_guard,
                               kernel=_kernel_silu, custom_op=_custom(True), verify_key=_signature,
                               prove=_prove_silu, fallback=_pair_fallback,
                               modules=(0,))  # the norm whose call the pair stands for: its hooks refuse it


def ltx_rmsnorm(norm: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``norm(x)`` for LTX-Video's VAE norm: aten's reduction and rsqrt, then the multiply and the cast in one pass on
    CUDA, bit-identical to eager everywhere (exact by construction, checked once per dtype).

    Args:
        norm: the norm module (diffusers' ``RMSNorm`` without weight, registered by the VAE adapter).
        x: ``[B, T, H, W, C]``: the channel-last view ``movedim(1, -1)`` of a channel-first activation.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return LTX_RMSNORM(site, norm, x)


def ltx_vae_rmsnorm_silu(norm: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``F.silu(norm(x))`` (LTX-Video's VAE norm and the ``nn.SiLU`` module after it) with the multiply, the cast and
    the SiLU in one pass after aten's reduction and rsqrt, bit-identical to eager everywhere (the norm exact by
    construction, the SiLU proven on every value of the dtype on first use). It stands for the norm's call: a norm
    with hooks refuses it and ``F.silu(norm(x))`` runs; the SiLU module's hooks are the caller's to check (as
    `diffusers_fastpath.models.vae.PairCalls` does).

    Args:
        norm: the norm module of the site (registered by the VAE adapter: `add_norm_class`).
        x: ``[B, T, H, W, C]``: the channel-last view ``movedim(1, -1)`` of a channel-first activation; the result is
            the same view of eager's (contiguous channel-first) memory, as the module call's then the SiLU's.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return LTX_VAE_RMSNORM_SILU(site, norm, x)
