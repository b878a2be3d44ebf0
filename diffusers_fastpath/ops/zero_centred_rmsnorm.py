"""Krea 2's zero-centred float32 RMSNorm of whole rows (``Krea2RMSNorm``: the blocks' ``norm1`` / ``norm2``, the
text fusion's and the output's norms) in one pass, bit-identical to eager.

The module computes, for bf16/fp16 x (T its dtype) of ``[..., C]``::

    y = F.rms_norm(x.float(), (C,), weight=self.weight + 1.0, eps=self.eps).to(T)     # a float32 weight

four kernels on CUDA: the upcast copy (x read in T, written in fp32), the float32 weight's add (C elements), aten's
fused rms_norm over the fp32 rows (``vectorized_layer_norm_kernel<float, float, rms_norm=true>``, reading the rows
twice and writing them in fp32) and the cast back (read fp32, write T): about 12 bytes moved per element against
this op's 4. The kernel is ``csrc/rotary.cu``'s row norm (``row_norm_rotary_kernel`` with ``kNoRotary``): aten's
vectorised kernel runs the same lanes for float as for T (``vec_size`` is 4 for every dtype: thread t of the (32, 4)
block squares elements 4(t + 128k)..4(t + 128k) + 3 of the row in an FMA chain, then the shuffle-down tree over
16..1 and the shared-memory halving of the four warps, then ``rsqrtf(sum / C + eps)``: the order
``qk_norm_rows_rope`` reproduces for LTX-Video's and Wan's QK norms, read off the SASS and probed on the GPU,
``tools/rms_norm_order_probe.py``), on the same values (the upcast is exact); the result ``w * (rstd * x)`` is
two fp32 products that the cast rounds to T once, as the kernel does. The weight ``self.weight + 1.0`` is the
forward's own float32 add, run as the forward runs it, before the launch. Rows of at most 128 elements (the text
refiner's 128-wide heads, [512, 12, 20, 128]) hold data in warp 0's lanes only, the other warps adding exact zeros:
``narrow_row_norm_kernel`` runs that order with a warp a row, 32 rows a block (a block of 128 threads a row took 324 us
there on the H100 against eager's 183); the same for `zero_centred_modulate` and `rms_norm_modulate_rows`.

The order is a property of the aten build, so the op verifies itself: the first fast call of each (dtype, C) is
compared with eager by ``torch.equal``; a mismatch disables it for the process with one warning and the norm runs as
written.

What the guard admits: a module of a class registered with `add_norm_class` (this package's subclass of a class
whose ``forward`` was proven to be the zero-centred norm above by source digest:
``models._chain_qk_fp32.is_zero_centred``), its ``weight`` a float32 ``[C]`` tensor on x's device, ``eps`` a python
float; a contiguous bf16/fp16 x of at least one dim with C = ``x.shape[-1]`` a multiple of 4 and at most 8192 (aten
takes its vectorised kernel for C % 4 == 0; the kernel keeps a row in registers), 8-byte aligned, at most 2^31 - 1
rows; no autograd; on CUDA. The result is contiguous, as eager's is. Anything else runs the module's forward as
diffusers wrote it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, EagerClasses, FusedOp, Site, autograd_device_reason, tensor_reason
from .qk_norm_rope import MAX_ROW_CHANNELS, ROW_NORM_FINAL, ROW_THREADS
from .rotary import (_NARROW_ROWS_PER_BLOCK, _NARROW_THREADS, _NARROW_WIDEST, _NO_MODULATE, _NO_SOURCE,
                     _NVRTC_NARROW_ROWS, _NVRTC_ROWS)

_NO_ROTARY = 3  # csrc/rotary.cu's kNoRotary form of row_norm_rotary_kernel
_NO_ROTARY_MODULATE = 4  # ... and its kNoRotaryModulate form (`zero_centred_modulate`)
_NORM_MODULATE_ROWS = 5  # ... its kNormModulateRows form (`rms_norm_modulate_rows`: torch.nn.RMSNorm, indexed rows)

_BASES = EagerClasses()  # this package's subclasses of the zero-centred norm classes, each with its diffusers class
# ``add_norm_class(cls, base)``: the guard takes modules of `cls`, a subclass of `base` (a class whose forward is the
# zero-centred norm) that adds no state and whose forward runs this op
add_norm_class = _BASES.add


def zero_centred_rmsnorm_ref(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The eager norm: the diffusers class's ``forward`` (so that a subclass whose forward runs this op falls back to
    diffusers' code, not to itself)."""
    return _BASES.eager(norm).forward(norm, x)


def zero_centred_rmsnorm_arithmetic(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm's computation from the tensors (the custom op's CPU path, the tests' emulated kernel)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight=weight + 1.0, eps=eps).to(x.dtype)


def _guard(norm, x: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    reason = _BASES.refusal(norm, "zero-centred RMSNorm")
    if reason is not None:
        return reason
    weight, eps = getattr(norm, "weight", None), getattr(norm, "eps", None)
    if type(eps) is not float:
        return "eps not a python float"
    reason = tensor_reason(x, HALF_DTYPES, 1, "[..., C]")
    if reason is not None:
        return reason
    dim = x.shape[-1]
    if not (isinstance(weight, torch.Tensor) and weight.dtype is torch.float32 and weight.shape == (dim,)):
        return "weight not a float32 [C] vector"
    if dim % 4 or not 0 < dim <= MAX_ROW_CHANNELS:
        return "C outside the reproduced reduction"
    if x.numel() == 0:
        return "empty"
    if x.numel() // dim > 0x7FFFFFFF:
        return "more than 2^31 - 1 rows"
    if not x.is_contiguous():
        return "x not contiguous"
    reason = autograd_device_reason(x, weight)
    if reason is not None:
        return reason
    if check_pointers and x.data_ptr() % 8:
        return "not 8-byte aligned"
    return None


# The NVRTC way: rotary.cu's row norm kernel in its kNoRotary form (kNoRotaryModulate with the modulate's rows;
# kNormModulateRows with torch.nn.RMSNorm's weight and the rows' index, `rms_norm_modulate_rows`), launched as
# bindings_rotary.cpp's zero_centred_launch does (x as [batch, seq, 1, C], one block of aten's (32, 4) threads per row;
# rows of at most 128 elements a warp each, narrow_row_norm_kernel's, as rotary.cu's launch() picks it; the output
# allocation); the guards stand for bindings_rotary.cpp's checks.
def nvrtc_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float, norm_final: int,
                       scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                       index: torch.Tensor | None = None) -> torch.Tensor:
    """The norm of x's rows ``[batch, seq, C]`` (with `scale` and `shift`, ``[batch or 1, C]`` rows, the modulate
    after it; with `index` too, int32 ``[batch * seq]``, a weight of x's dtype and the modulate of ``[rows, C]``
    tables read through the index), into a new contiguous tensor."""
    batch, seq, dim = x.shape
    out = x.new_empty(x.shape)
    if out.numel() == 0:
        return out
    img = (x.data_ptr(), seq * dim, dim, dim, seq, weight.data_ptr(), eps)
    indexed = index is not None
    if scale is None:
        modulate, form = _NO_MODULATE, _NO_ROTARY
    else:
        modulate = (scale.data_ptr(), shift.data_ptr(), 0 if scale.shape[0] == 1 and not indexed else scale.stride(0),
                    0 if shift.shape[0] == 1 and not indexed else shift.stride(0),
                    index.data_ptr() if indexed else 0, scale.shape[0] if indexed else 0)
        form = _NORM_MODULATE_ROWS if indexed else _NO_ROTARY_MODULATE
    args = (out.data_ptr(), *_NO_SOURCE, *img, 0, 0, 0, 0, 0, batch, 1, dim, False, False, True, False, not indexed,
            _nvrtc.DTYPE_CODE[x.dtype], norm_final, *modulate)
    blocks = -(-batch * seq // _NARROW_ROWS_PER_BLOCK)
    if dim <= _NARROW_WIDEST and blocks <= 0x7FFFFFFF:  # a warp a row (rotary.cu's narrow_row_norm_kernel)
        _NVRTC_NARROW_ROWS.launch(x.device.index, (x.dtype, form), (blocks, 1, 1), (_NARROW_THREADS, 1, 1), *args)
    else:
        _NVRTC_ROWS.launch(x.device.index, (x.dtype, form, False), (seq, batch, 1), (ROW_THREADS, 1, 1), *args)
    return out


def _nvrtc_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float, norm_final: int) -> torch.Tensor:
    return nvrtc_zero_centred(x.view(1, *x.shape), weight, eps, norm_final).view(x.shape)


def raw_reason(x, weight, norm_final, dims: int = 2) -> str | None:
    """bindings_rotary.cpp's checks of x (``[rows, C]``, or with `dims` 3 ``[batch, seq, C]``), the weight and
    `norm_final`: ``None``, or what fails."""
    if not (isinstance(x, torch.Tensor) and x.dim() == dims and x.dtype in HALF_DTYPES and x.is_contiguous()):
        return "x"
    rows = x.shape[0] <= 0x7FFFFFFF if dims == 2 else x.shape[0] <= 65535 and x.shape[1] <= 0x7FFFFFFF
    if x.shape[-1] % 4 or not 0 < x.shape[-1] <= MAX_ROW_CHANNELS or not rows or x.data_ptr() % 8:
        return "C, rows or alignment"
    if not (weight.dtype is torch.float32 and weight.shape == (x.shape[-1],) and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0):
        return "weight"
    if norm_final not in (0, 1, 2):
        return "norm_final"
    if not x.is_cuda or weight.device != x.device:
        return "device"
    return None


def _raw_guard(x, weight, eps, norm_final):
    return raw_reason(x, weight, norm_final)


_nvrtc.raw_op("_zero_centred_rmsnorm_cuda", "(Tensor x, Tensor weight, float eps, int norm_final) -> Tensor",
              _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_zero_centred_rmsnorm_cuda")  # (x [rows, C], weight + 1, eps, norm_final)


def _fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel over x's rows, with the forward's own float32 add ``weight + 1.0`` made first."""
    return _launch(x.view(-1, x.shape[-1]), weight + 1.0, eps, ROW_NORM_FINAL).view(x.shape)


def _kernel(norm, x: torch.Tensor) -> torch.Tensor:
    return _fused(x, norm.weight, norm.eps)


@torch.library.custom_op("diffusers_fastpath::zero_centred_rmsnorm", mutates_args=())
def _zero_centred_rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # What torch.compile runs: the kernel on CUDA (the caller's guard admitted these inputs; torch.compile emits this
    # op only for signatures already verified, see FusedOp), the arithmetic elsewhere.
    if x.is_cuda:
        return _fused(x, weight, eps)
    return zero_centred_rmsnorm_arithmetic(x, weight, eps)


@_zero_centred_rmsnorm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


ZERO_CENTRED_RMSNORM = FusedOp(
    "zero_centred_rmsnorm",
    ref=zero_centred_rmsnorm_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=lambda norm, x: torch.ops.diffusers_fastpath.zero_centred_rmsnorm.default(x, norm.weight, norm.eps),
    verify_key=lambda norm, x: (str(x.dtype).removeprefix("torch."), x.shape[-1], "zero-centred norm rows"),
    # no `modules`: this op is the norm's forward itself (the swapped class's), reached through the module's call,
    # so its hooks have run
)


def zero_centred_rmsnorm(norm: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``norm(x)`` for Krea 2's zero-centred float32 RMSNorm, in one pass on CUDA (self-verified), bit-identical to
    eager everywhere.

    Args:
        norm: the norm module (of a class registered by `add_norm_class`), whose forward this is (its hooks have run:
            the module's own call); ``weight`` float32 ``[C]`` (the scale is ``1 + weight``), ``eps``.
        x: ``[..., C]`` bf16/fp16 activations, contiguous.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return ZERO_CENTRED_RMSNORM(site, norm, x)
