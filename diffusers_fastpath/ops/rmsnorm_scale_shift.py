"""diffusers' ``RMSNorm`` and the elementwise step after it, in one pass, bit-identical to the eager chain: one kernel
(``csrc/rmsnorm_scale_shift.cu``), four ops by what follows the norm.

ERNIE-Image's adaLN (``ErnieImageSharedAdaLNBlock``), T the storage dtype::

    x = residual + (gate.float() * update.float()).to(T2)           # gated variant only; x is also returned
    y = norm(x)                                                     # diffusers RMSNorm, see _rms_norm below
    out = (y.float() * (1 + scale.float()) + shift.float()).to(T)   # rmsnorm_scale_shift / gated_rmsnorm_scale_shift

(T2 is the dtype of the block's previous modulate output: T, except where autocast or an fp32 norm weight make it
fp32 while the residual stream is T; the kernel takes only T2 == T, the eager chain runs otherwise.)

Z-Image's and Lumina2's sandwich norms (``ZImageTransformerBlock``, ``Lumina2TransformerBlock``), all in T::

    out = norm(x) * scale                                           # rmsnorm_scale: the branch input
    out = residual + gate * norm(x)                                 # rmsnorm_gated_residual: the branch output

The kernel keeps every rounding point of these chains and reproduces the order in
which aten's reduce kernel sums ``x.float().pow(2)`` over the last dimension (Reduce.cuh: input vectorised by 4,
one warp per row, four accumulators per lane, shuffle-down tree). That order is a property of the aten build it
runs against, so each op verifies itself: the first fast call of each signature (dtype, row length; each op
keeps its own) is compared with eager by ``torch.equal``, and a mismatch disables it for the process with
one warning. The guard
admits only rows where aten uses that configuration: row length D a multiple of 128 with 512 < D < 8192, at least
16 rows, fp32 squares addressable with 32-bit offsets; and only the norm whose numbers the kernel computes
(`norm_reason`): diffusers' ``RMSNorm`` itself or this package's ``FastpathRMSNorm`` (not ``torch.nn.RMSNorm``, not a
subclass with a forward of its own), with a ``[D]`` weight of x's dtype and no bias; operands that are tensors (a
Python-number scale, shift or gate runs eager).

Shapes: three-dimensional operands, ``[seq, batch, dim]`` for ERNIE-Image, ``[batch, seq, dim]`` for Z-Image (the
kernel only needs row ``(i, j)`` of each at ``i * stride(0) + j * stride(1)``); ``x``/``residual`` of the ERNIE ops
and the norm input of the others contiguous; the other operands any row strides with unit innermost stride
(``update`` is ERNIE's attention output permuted back to sequence-first, strided for batch > 1). The scale and gate
of `rmsnorm_scale` and `rmsnorm_gated_residual` may be rows broadcast over the sequence (``[batch, 1, dim]``), or
(`rmsnorm_scale_rows`, `rmsnorm_gated_residual_rows`) Bria FIBO 2's and Z-Image's per-token rows that their
``select_per_token`` picks with a ``torch.where``, read through an index (`selected_rows.TokenRows`: a ``[2B, D]``
table and an int32 ``[B, S]`` index, the ``[B, S, D]`` rows never written out).
"""

from __future__ import annotations

import struct

import torch
from diffusers.models.normalization import RMSNorm

from . import _nvrtc
from ._aten_reduce import MAX_VALUES_PER_THREAD, WARP
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site
from .gated_residual import gated_residual
from .selected_rows import TokenRows

# The norm classes the kernel computes (`norm_reason`): diffusers' RMSNorm itself (not a subclass, whose forward may
# be its own; not torch.nn.RMSNorm, which computes otherwise), the custom ops' stand-in `_Norm` (added below) and this
# package's FastpathRMSNorm, which `models._qk_norms` adds where it defines it (the ops import no models).
RMSNORM_CLASSES: set[type] = {RMSNorm}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """diffusers' ``RMSNorm.forward`` (no bias, not NPU; a weight, or none as LTX-Video's) as a function, for the
    custom ops' eager path."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight is None:
        return y.to(x.dtype)
    if weight.dtype in HALF_DTYPES:
        y = y.to(weight.dtype)
    return y * weight


def _modulate(y: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return (y.float() * (1 + scale.float()) + shift.float()).to(y.dtype)


def _gated_residual(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, dtype=None) -> torch.Tensor:
    return residual + (gate.float() * update.float()).to(residual.dtype if dtype is None else dtype)


def rmsnorm_scale_shift_ref(norm, x, scale, shift):
    """The eager chain, through the diffusers ``RMSNorm`` module itself."""
    return _modulate(norm(x), scale, shift)


def gated_rmsnorm_scale_shift_ref(norm, residual, gate, update, scale, shift, dtype=None):
    """The eager chain; ``dtype`` is what the gated product is cast to (diffusers: its previous modulate output's
    dtype; default ``residual.dtype``)."""
    x = _gated_residual(residual, gate, update, dtype)
    return x, _modulate(norm(x), scale, shift)


def rmsnorm_scale_ref(norm, x, scale):
    """The eager chain: ``norm(x) * scale``, through the diffusers ``RMSNorm`` module itself."""
    return norm(x) * scale


def rmsnorm_gated_residual_ref(norm, residual, gate, x):
    """The eager chain: ``residual + gate * norm(x)``, through the diffusers ``RMSNorm`` module itself."""
    return residual + gate * norm(x)


def _rmsnorm_gated_residual_fallback(norm, residual, gate, x):
    # the norm as written, its gated residual still the exact fused one (which has its own guard)
    return gated_residual(residual, gate, norm(x))


NOT_A_TENSOR = "operand not a tensor"  # a Python scalar scale, shift or gate: eager broadcasts it


def _rows_ok(t: torch.Tensor, like: torch.Tensor) -> bool:
    return (
        t.dtype is like.dtype
        and t.shape == like.shape
        and t.stride(2) == 1
        and t.stride(0) % 4 == 0
        and t.stride(1) % 4 == 0
        and t.device == like.device
    )


def norm_reason(norm, x, weightless: bool = False) -> str | None:
    """What the kernel needs of the norm and the input's dtype: diffusers' RMSNorm (a class of `RMSNORM_CLASSES`) with
    a ``[D]`` weight of that dtype over x's rows of D (or, `weightless`, none), no bias (fp16 or bf16)."""
    if type(norm) not in RMSNORM_CLASSES:
        return "norm not diffusers' RMSNorm"
    weight = getattr(norm, "weight", None)
    if (weight is None and not weightless) or getattr(norm, "bias", None) is not None:
        return "norm without weight or with bias"
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if weight is not None and weight.dtype is not x.dtype:
        return "mixed dtypes"
    if weight is not None and weight.shape != x.shape[-1:]:
        return "norm weight shape"  # eager broadcasts another (a [1] weight, a [S, D] one); the kernel reads [D]
    return None


def _guard_rows(norm, x, operands, check_pointers, weightless: bool = False) -> str | None:
    reason = norm_reason(norm, x, weightless)
    if reason is not None:
        return reason
    tensors = (x,) if norm.weight is None else (x, norm.weight)  # the norm's own (a weightless one has only x)
    if x.dim() != 3:
        return "shape"
    seq, batch, dim = x.shape
    if dim % 128 or not 512 < dim < 8192:
        return "D outside the reproduced reduction"
    if seq * batch < 16:
        return "fewer than 16 rows"
    if seq * batch * dim * 4 >= 2**31:
        return "too large for aten's 32-bit reduction"
    if not x.is_contiguous():
        return "x not contiguous"
    if not all(_rows_ok(t, x) for t in operands):
        return "operands strided or mismatched"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *operands)):
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if any(t.device != x.device for t in tensors):
        return "devices differ"
    if check_pointers and any(t.data_ptr() % 8 for t in (*tensors, *operands)):
        return "not 8-byte aligned"
    return None


def _guard(norm, x, scale, shift, check_pointers: bool = True) -> str | None:
    return _guard_rows(norm, x, (scale, shift), check_pointers)


def _broadcast_rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """`t` as a view of `like`'s shape where it is `like`'s shape or rows broadcast over dims 0 and/or 1 (a
    ``[batch, 1, dim]`` scale or gate), else None."""
    if t.dim() != 3 or like.dim() != 3 or t.shape[2] != like.shape[2]:
        return None
    if any(t.shape[i] not in (1, like.shape[i]) for i in (0, 1)):
        return None
    return t if t.shape == like.shape else t.expand(like.shape)


def broadcast_guard(norm, x, operands, check_pointers: bool = True, weightless: bool = False) -> str | None:
    """`_guard_rows` for operands of x's shape or rows broadcast over its first two dims (`_broadcast_rows`)."""
    if not all(isinstance(t, torch.Tensor) for t in operands):
        return NOT_A_TENSOR
    rows = [_broadcast_rows(t, x) for t in operands]
    if any(t is None for t in rows):
        return "operands strided or mismatched"
    return _guard_rows(norm, x, rows, check_pointers, weightless)


def _scale_guard(norm, x, scale, check_pointers: bool = True) -> str | None:
    return broadcast_guard(norm, x, (scale,), check_pointers)


def _gated_residual_guard(norm, residual, gate, x, check_pointers: bool = True) -> str | None:
    if not (isinstance(residual, torch.Tensor) and isinstance(gate, torch.Tensor)):
        return NOT_A_TENSOR
    gate = _broadcast_rows(gate, x)
    if gate is None or residual.shape != x.shape:
        return "operands strided or mismatched"
    return _guard_rows(norm, x, (gate, residual), check_pointers)


def _gated_guard(norm, residual, gate, update, scale, shift, dtype=None, check_pointers: bool = True) -> str | None:
    if dtype is not None and dtype is not residual.dtype:
        return "mixed dtypes"
    return _guard_rows(norm, residual, (gate, update, scale, shift), check_pointers)


# The NVRTC way (ops/_nvrtc.py): csrc/rmsnorm_scale_shift.cu's kernel, launched as its launch() and bindings_norms.cpp's
# rmsnorm_launch do: kWarpsPerBlock 8 rows per block of 256 threads (tests/test_nvrtc.py reads it from the
# .cu). Duplicated from there: that shape, the RmsNormScaleShiftArgs and Rows fields (fastpath.h), rows_of (pointer,
# stride(0), stride(1)), eps as static_cast<float>, aten's mean factor float(rows) / float(rows * dim) in float32,
# the RmsEpilogue values and the output allocation; the guard stands for bindings_norms.cpp's input checks.
(SCALE_SHIFT, SCALE, GATED_RESIDUAL, ROPE_COMPLEX, ROPE_REAL, PLAIN, MODULATE, ROPE_COMPLEX128, SCALE_ROWS,
 GATED_RESIDUAL_ROWS) = range(10)  # RmsEpilogue
_EPILOGUE_NAME = {SCALE_SHIFT: "kScaleShift", SCALE: "kScale", GATED_RESIDUAL: "kGatedResidual",
                  ROPE_COMPLEX: "kRopeComplex", ROPE_REAL: "kRopeReal", PLAIN: "kPlain", MODULATE: "kModulate",
                  ROPE_COMPLEX128: "kRopeComplex128", SCALE_ROWS: "kScaleRows", GATED_RESIDUAL_ROWS: "kGatedResidualRows"}
_ROWS = _nvrtc.Params("Rows", ("ptr", "P"), ("stride_s", "q"), ("stride_b", "q"))
_ARGS = _nvrtc.Params("RmsNormScaleShiftArgs", ("out", "P"), ("residual_out", "P"), ("x", _ROWS), ("gate", _ROWS),
                      ("update", _ROWS), ("scale", _ROWS), ("shift", _ROWS), ("residual", _ROWS), ("freqs", _ROWS),
                      ("sin", _ROWS), ("weight", "P"), ("seq", "q"), ("batch", "q"), ("dim", "q"), ("heads", "q"),
                      ("tokens", "q"), ("eps", "f"), ("mean_factor", "f"), ("gated", "?"), ("dtype", "i"), ("epilogue", "i"),
                      ("index", "P"), ("table_rows", "q"))
_INDEXED = (SCALE_ROWS, GATED_RESIDUAL_ROWS)  # is_indexed(): no rows-of-128 path (one row a warp at any width)
_VARIANTS = ((False, SCALE_SHIFT), (True, SCALE_SHIFT), (False, SCALE), (False, GATED_RESIDUAL), (False, ROPE_COMPLEX),
             (False, ROPE_REAL), (False, PLAIN), (False, MODULATE), (False, ROPE_COMPLEX128), (False, SCALE_ROWS),
             (False, GATED_RESIDUAL_ROWS))
_NVRTC = _nvrtc.Kernel(
    "rmsnorm_scale_shift.cu",
    "diffusers_fastpath::rmsnorm_scale_shift_kernel",
    {(dtype, gated, epilogue): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(gated).lower()}, "
                               f"diffusers_fastpath::RmsEpilogue::{_EPILOGUE_NAME[epilogue]}"
     for dtype in HALF_DTYPES for gated, epilogue in _VARIANTS},
    _nvrtc.Params("rmsnorm_scale_shift_kernel", ("a", _ARGS)),
)
_WARPS_PER_BLOCK = 8
_ROWS64_PER_BLOCK = 64  # kRows64PerBlock: the norm alone over rows of 64, eight rows per warp
_ROWS128_PER_BLOCK = 32  # kRows128PerBlock: rows of 128, four per warp
# the norm alone over rows wider than kWarpRowWidest: rmsnorm_wide_kernel, one row per block of kWideThreads
_WARP_ROW_WIDEST, _WIDE_THREADS = WARP * (MAX_VALUES_PER_THREAD - 1), 512  # 8160: ceil(D / 32) < 256
_NVRTC_WIDE = _nvrtc.Kernel(
    "rmsnorm_scale_shift.cu", "diffusers_fastpath::rmsnorm_wide_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES}, _nvrtc.Params("rmsnorm_wide_kernel", ("a", _ARGS)))
_NONE = (0, 0, 0)


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _rows(t: torch.Tensor | tuple | None) -> tuple[int, int, int]:
    if isinstance(t, tuple):  # a table's rows as the indexed epilogues read them (`_table_rows`)
        return t
    return _NONE if t is None else (t.data_ptr(), t.stride(0), t.stride(1))


def _table_rows(table: torch.Tensor) -> tuple[int, int, int]:
    """A ``[rows, D]`` table as bindings_norms.cpp's `indexed_table` hands it to the indexed epilogues: row ``t`` at
    ``ptr + t * stride_s``."""
    return (table.data_ptr(), table.stride(0), 0)


def _nvrtc_launch(out, residual_out, x, weight, eps: float, epilogue: int = SCALE_SHIFT, gate=None, update=None,
                  scale=None, shift=None, residual=None, freqs=_NONE, heads: int = 1, tokens: int = 1,
                  sin=_NONE, index: torch.Tensor | None = None, table_rows: int = 0) -> None:
    seq, batch, dim = x.shape
    rows, device, gated = seq * batch, x.device.index, update is not None
    for t in (out, residual_out) if gated else (out,):
        _nvrtc.check_out("rmsnorm_scale_shift", t, x.shape, x, 8)
    # launch()'s grid: rows_per_block() of rmsnorm_scale_shift.cu, or one row per block of the wide kernel
    if not gated and epilogue == PLAIN and dim > _WARP_ROW_WIDEST:
        kernel, key, grid, block = _NVRTC_WIDE, x.dtype, (rows, 1, 1), (_WIDE_THREADS, 1, 1)
    else:
        per_block = (_ROWS128_PER_BLOCK if not gated and dim == 128 and epilogue not in _INDEXED else
                     _ROWS64_PER_BLOCK if epilogue == PLAIN and dim == 64 else _WARPS_PER_BLOCK)
        kernel, key = _NVRTC, (x.dtype, gated, epilogue)
        grid, block = ((rows + per_block - 1) // per_block, 1, 1), (_WARPS_PER_BLOCK * 32, 1, 1)
    kernel.launch(
        device, key, grid, block, out.data_ptr(), residual_out.data_ptr() if gated else 0,
        *_rows(x), *_rows(gate), *_rows(update), *_rows(scale), *_rows(shift), *_rows(residual), *freqs, *sin,
        0 if weight is None else weight.data_ptr(), seq, batch, dim, heads, tokens, eps,
        _f32(_f32(rows) / _f32(rows * dim)), gated, _nvrtc.DTYPE_CODE[x.dtype], epilogue,
        0 if index is None else index.data_ptr(), table_rows)


def _nvrtc_kernel(x, weight, scale, shift, eps: float, out=None) -> torch.Tensor:
    out = x.new_empty(x.shape) if out is None else out
    _nvrtc_launch(out, None, x, weight, eps, scale=scale, shift=shift)
    return out


def _nvrtc_gated_kernel(residual, gate, update, weight, scale, shift, eps: float, out=None):
    residual_out, out = (residual.new_empty(residual.shape), residual.new_empty(residual.shape)) if out is None else out
    _nvrtc_launch(out, residual_out, residual, weight, eps, gate=gate, update=update, scale=scale, shift=shift)
    return residual_out, out


def _nvrtc_scale_kernel(x, weight, scale, eps: float, out=None) -> torch.Tensor:
    out = x.new_empty(x.shape) if out is None else out
    _nvrtc_launch(out, None, x, weight, eps, SCALE, scale=scale)
    return out


def _nvrtc_gated_residual_kernel(residual, gate, x, weight, eps: float, out=None) -> torch.Tensor:
    out = x.new_empty(x.shape) if out is None else out
    _nvrtc_launch(out, None, x, weight, eps, GATED_RESIDUAL, gate=gate, residual=residual)
    return out


def _raw_guard(x, weight, scale, shift, eps):
    return _guard(_Norm(weight, eps), x, scale, shift)


def _raw_gated_guard(residual, gate, update, weight, scale, shift, eps):
    return _gated_guard(_Norm(weight, eps), residual, gate, update, scale, shift)


def _raw_scale_guard(x, weight, scale, eps):
    return _guard_rows(_Norm(weight, eps), x, (scale,), True)  # bindings_norms.cpp takes operands of x's shape only


def _raw_gated_residual_guard(residual, gate, x, weight, eps):
    return _guard_rows(_Norm(weight, eps), x, (gate, residual), True)


_nvrtc.raw_op("_rmsnorm_scale_shift_cuda", "(Tensor x, Tensor weight, Tensor scale, Tensor shift, float eps) -> Tensor",
              _raw_guard, _nvrtc_kernel)
_nvrtc.raw_op("_rmsnorm_scale_shift_cuda_out",
              "(Tensor(a!) out, Tensor x, Tensor weight, Tensor scale, Tensor shift, float eps) -> ()",
              _raw_guard, _nvrtc_kernel, outs=1)
_nvrtc.raw_op("_gated_rmsnorm_scale_shift_cuda",
              "(Tensor residual, Tensor gate, Tensor update, Tensor weight, Tensor scale, Tensor shift, float eps) -> "
              "(Tensor, Tensor)", _raw_gated_guard, _nvrtc_gated_kernel)
_nvrtc.raw_op("_gated_rmsnorm_scale_shift_cuda_out",
              "(Tensor(a!) residual_out, Tensor(b!) out, Tensor residual, Tensor gate, Tensor update, Tensor weight, "
              "Tensor scale, Tensor shift, float eps) -> ()", _raw_gated_guard, _nvrtc_gated_kernel, outs=2)

_nvrtc.raw_op("_rmsnorm_scale_cuda", "(Tensor x, Tensor weight, Tensor scale, float eps) -> Tensor",
              _raw_scale_guard, _nvrtc_scale_kernel)
_nvrtc.raw_op("_rmsnorm_scale_cuda_out", "(Tensor(a!) out, Tensor x, Tensor weight, Tensor scale, float eps) -> ()",
              _raw_scale_guard, _nvrtc_scale_kernel, outs=1)
_nvrtc.raw_op("_rmsnorm_gated_residual_cuda",
              "(Tensor residual, Tensor gate, Tensor x, Tensor weight, float eps) -> Tensor",
              _raw_gated_residual_guard, _nvrtc_gated_residual_kernel)
_nvrtc.raw_op("_rmsnorm_gated_residual_cuda_out",
              "(Tensor(a!) out, Tensor residual, Tensor gate, Tensor x, Tensor weight, float eps) -> ()",
              _raw_gated_residual_guard, _nvrtc_gated_residual_kernel, outs=1)

_launch = LazyLauncher(_nvrtc_kernel, "_rmsnorm_scale_shift_cuda")
_gated_launch = LazyLauncher(_nvrtc_gated_kernel, "_gated_rmsnorm_scale_shift_cuda")
_scale_launch = LazyLauncher(_nvrtc_scale_kernel, "_rmsnorm_scale_cuda")
_gated_residual_launch = LazyLauncher(_nvrtc_gated_residual_kernel, "_rmsnorm_gated_residual_cuda")


def _kernel(norm, x, scale, shift):
    return _launch(x, norm.weight, scale, shift, norm.eps)


def _gated_kernel(norm, residual, gate, update, scale, shift, dtype=None):
    return _gated_launch(residual, gate, update, norm.weight, scale, shift, norm.eps)


def _scale_kernel(norm, x, scale):
    return _scale_launch(x, norm.weight, _broadcast_rows(scale, x), norm.eps)


def _gated_residual_kernel(norm, residual, gate, x):
    return _gated_residual_launch(residual, _broadcast_rows(gate, x), x, norm.weight, norm.eps)


class _Norm:
    """What the guard reads of an ``RMSNorm`` module, for the custom ops (which take tensors and floats)."""

    __slots__ = ("weight", "eps")
    bias = None

    def __init__(self, weight: torch.Tensor | None, eps: float) -> None:
        self.weight, self.eps = weight, eps


RMSNORM_CLASSES.add(_Norm)


@torch.library.custom_op("diffusers_fastpath::rmsnorm_scale_shift", mutates_args=())
def _rmsnorm_scale_shift_op(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _guard(norm, x, scale, shift) is None:
        return _kernel(norm, x, scale, shift)
    return _modulate(_rms_norm(x, weight, eps), scale, shift).contiguous()


@_rmsnorm_scale_shift_op.register_fake
def _(x, weight, scale, shift, eps):
    torch._check(x.dim() == 3, lambda: "rmsnorm_scale_shift: x must be [seq, batch, dim]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("diffusers_fastpath::gated_rmsnorm_scale_shift", mutates_args=())
def _gated_rmsnorm_scale_shift_op(
    residual: torch.Tensor,
    gate: torch.Tensor,
    update: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    norm = _Norm(weight, eps)
    if _gated_guard(norm, residual, gate, update, scale, shift) is None:
        return _gated_kernel(norm, residual, gate, update, scale, shift)
    x = _gated_residual(residual, gate, update).contiguous()
    return x, _modulate(_rms_norm(x, weight, eps), scale, shift).contiguous()


@_gated_rmsnorm_scale_shift_op.register_fake
def _(residual, gate, update, weight, scale, shift, eps):
    torch._check(residual.dim() == 3, lambda: "gated_rmsnorm_scale_shift: residual must be [seq, batch, dim]")
    like = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return like, torch.empty_like(like)


@torch.library.custom_op("diffusers_fastpath::rmsnorm_scale", mutates_args=())
def _rmsnorm_scale_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _scale_guard(norm, x, scale) is None:
        return _scale_kernel(norm, x, scale)
    return (_rms_norm(x, weight, eps) * scale).contiguous()


@_rmsnorm_scale_op.register_fake
def _(x, weight, scale, eps):
    torch._check(x.dim() == 3, lambda: "rmsnorm_scale: x must be three-dimensional")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("diffusers_fastpath::rmsnorm_gated_residual", mutates_args=())
def _rmsnorm_gated_residual_op(residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _gated_residual_guard(norm, residual, gate, x) is None:
        return _gated_residual_kernel(norm, residual, gate, x)
    return (residual + gate * _rms_norm(x, weight, eps)).contiguous()


@_rmsnorm_gated_residual_op.register_fake
def _(residual, gate, x, weight, eps):
    torch._check(x.dim() == 3, lambda: "rmsnorm_gated_residual: x must be three-dimensional")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _signature(norm, x, *rest):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1])


def _gated_residual_signature(norm, residual, gate, x):
    return _signature(norm, x)


RMSNORM_SCALE_SHIFT = FusedOp(
    "rmsnorm_scale_shift",
    ref=rmsnorm_scale_shift_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=lambda norm, x, scale, shift: torch.ops.diffusers_fastpath.rmsnorm_scale_shift.default(
        x, norm.weight, scale, shift, norm.eps
    ),
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)

GATED_RMSNORM_SCALE_SHIFT = FusedOp(
    "gated_rmsnorm_scale_shift",
    ref=gated_rmsnorm_scale_shift_ref,
    guard=_gated_guard,
    kernel=_gated_kernel,
    custom_op=lambda norm, residual, gate, update, scale, shift, dtype=None: (
        torch.ops.diffusers_fastpath.gated_rmsnorm_scale_shift.default(
            residual, gate, update, norm.weight, scale, shift, norm.eps
        )
    ),
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def rmsnorm_scale_shift(norm, x, scale, shift, site: Site | None = None) -> torch.Tensor:
    """``(norm(x).float() * (1 + scale.float()) + shift.float()).to(dtype)``, fused and bit-identical.

    Args:
        norm: the diffusers ``RMSNorm`` module (its ``weight`` and ``eps`` are used; it runs itself on fallback).
        x: ``[seq, batch, dim]`` activations.
        scale, shift: ``[seq, batch, dim]`` modulation (ERNIE-Image expands its adaLN rows to this shape).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers.models.normalization import RMSNorm
        >>> from diffusers_fastpath.ops import rmsnorm_scale_shift, rmsnorm_scale_shift_ref
        >>> norm, x, s, h = RMSNorm(768, eps=1e-6), *torch.randn(3, 32, 1, 768)
        >>> torch.equal(rmsnorm_scale_shift(norm, x, s, h), rmsnorm_scale_shift_ref(norm, x, s, h))
        True
    """
    return RMSNORM_SCALE_SHIFT(site, norm, x, scale, shift)


def gated_rmsnorm_scale_shift(norm, residual, gate, update, scale, shift, site: Site | None = None, dtype=None):
    """``x = residual + (gate.float() * update.float()).to(dtype)``, then `rmsnorm_scale_shift` of ``x``.

    ``dtype`` (default ``residual.dtype``) is the dtype diffusers casts the gated product to: its block's previous
    modulate output's. Where it differs from the residual's (autocast, an fp32 norm weight), the eager chain runs.

    Returns:
        ``(x, out)``: the new residual stream and the modulated norm, both bit-identical to eager.
    """
    return GATED_RMSNORM_SCALE_SHIFT(site, norm, residual, gate, update, scale, shift, dtype)


RMSNORM_SCALE = FusedOp(
    "rmsnorm_scale",
    ref=rmsnorm_scale_ref,
    guard=_scale_guard,
    kernel=_scale_kernel,
    custom_op=lambda norm, x, scale: torch.ops.diffusers_fastpath.rmsnorm_scale.default(x, norm.weight, scale, norm.eps),
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)

RMSNORM_GATED_RESIDUAL = FusedOp(
    "rmsnorm_gated_residual",
    ref=rmsnorm_gated_residual_ref,
    guard=_gated_residual_guard,
    kernel=_gated_residual_kernel,
    custom_op=lambda norm, residual, gate, x: torch.ops.diffusers_fastpath.rmsnorm_gated_residual.default(
        residual, gate, x, norm.weight, norm.eps),
    verify_key=_gated_residual_signature,
    fallback=_rmsnorm_gated_residual_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def rmsnorm_scale(norm, x, scale, site: Site | None = None) -> torch.Tensor:
    """``norm(x) * scale``, fused and bit-identical (Z-Image's and Lumina2's branch inputs).

    Args:
        norm: the diffusers ``RMSNorm`` module (its ``weight`` and ``eps`` are used; it runs itself on fallback).
        x: ``[batch, seq, dim]`` activations (any three dimensions; contiguous for the kernel).
        scale: ``x``'s shape, or rows broadcast over the sequence (``[batch, 1, dim]``), of ``x``'s dtype.
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers.models.normalization import RMSNorm
        >>> from diffusers_fastpath.ops import rmsnorm_scale, rmsnorm_scale_ref
        >>> norm, x, s = RMSNorm(768, eps=1e-6), torch.randn(1, 32, 768), torch.randn(1, 1, 768)
        >>> torch.equal(rmsnorm_scale(norm, x, s), rmsnorm_scale_ref(norm, x, s))
        True
    """
    return RMSNORM_SCALE(site, norm, x, scale)


def rmsnorm_gated_residual(norm, residual, gate, x, site: Site | None = None) -> torch.Tensor:
    """``residual + gate * norm(x)``, fused and bit-identical (Z-Image's and Lumina2's branch outputs).

    Args:
        norm: the diffusers ``RMSNorm`` module; where the kernel cannot run, it runs itself and the gated residual is
            the exact fused `gated_residual`.
        residual: the ``[batch, seq, dim]`` stream.
        gate: ``x``'s shape, or rows broadcast over the sequence (``[batch, 1, dim]``), of ``x``'s dtype.
        x: the branch output to normalise, ``residual``'s shape (contiguous for the kernel).
        site: the call site's counters.
    """
    return RMSNORM_GATED_RESIDUAL(site, norm, residual, gate, x)


# --- indexed rows: Bria FIBO 2's and Z-Image's select_per_token rows (ops/selected_rows.py's TokenRows) -------------


def rmsnorm_scale_rows_ref(norm, x, rows: TokenRows):
    """The eager chain: ``norm(x) * scale`` with the rows written out as the model writes them."""
    return norm(x) * rows.materialize()


def rmsnorm_gated_residual_rows_ref(norm, residual, rows: TokenRows, x):
    """The eager chain: ``residual + gate * norm(x)`` with the rows written out as the model writes them."""
    return residual + rows.materialize() * norm(x)


def _rmsnorm_gated_residual_rows_fallback(norm, residual, rows, x):
    # (`_rmsnorm_gated_residual_fallback`'s: the norm as written, its gated residual the exact fused one)
    return gated_residual(residual, rows.materialize(), norm(x))


def _table_reason(table: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why the kernel cannot read the ``[rows, D]`` table's rows as quads (bindings_norms.cpp's `indexed_table`: unit
    innermost stride, rows of whole 8-byte quads; the first row's pointer `_guard_rows` checks), or ``None``."""
    if table.dim() != 2 or table.shape[0] == 0 or table.shape[1] != x.shape[-1]:
        return "the table must be [rows, dim]"
    if table.stride(1) != 1 or (table.shape[0] > 1 and table.stride(0) % 4):
        return "table rows strided"
    return None


def _first_row(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The table's first row as an operand of x's shape (stride 0: `_guard_rows` then checks its dtype, device,
    alignment and grad as it checks any operand's)."""
    return table[:1].unsqueeze(0).expand(x.shape)


def _rows_reason(rows, x) -> str | None:
    if type(rows) is not TokenRows:
        return NOT_A_TENSOR
    index = rows.index()
    reason = rows.reason(x) or _table_reason(rows.table(), x)
    if reason is None and not (index.dtype is torch.int32 and index.is_contiguous()):
        reason = "index must be a contiguous int32 [batch, seq] tensor on x's device"
    return reason


def _scale_rows_guard(norm, x, rows, check_pointers: bool = True) -> str | None:
    reason = _rows_reason(rows, x)
    if reason is not None:
        return reason
    return _guard_rows(norm, x, (_first_row(rows.table(), x),), check_pointers)


def _gated_residual_rows_guard(norm, residual, rows, x, check_pointers: bool = True) -> str | None:
    reason = _rows_reason(rows, x)
    if reason is not None:
        return reason
    if not isinstance(residual, torch.Tensor):
        return NOT_A_TENSOR
    if residual.shape != x.shape:
        return "operands strided or mismatched"
    return _guard_rows(norm, x, (_first_row(rows.table(), x), residual), check_pointers)


def _raw_table_reason(x, table, index) -> str | None:
    """bindings_norms.cpp's `indexed_table` checks (the index's values are checked by the kernel, which traps)."""
    if not all(isinstance(t, torch.Tensor) for t in (x, table, index)) or x.dim() != 3:
        return "shape"
    if (index.dtype is not torch.int32 or not index.is_contiguous() or index.shape != x.shape[:2]
            or index.device != x.device):
        return "index must be a contiguous int32 [batch, seq] tensor on x's device"
    return _table_reason(table, x)


def _raw_scale_rows_guard(x, weight, table, index, eps):
    return _raw_table_reason(x, table, index) or _guard_rows(_Norm(weight, eps), x, (_first_row(table, x),), True)


def _raw_gated_residual_rows_guard(residual, table, index, x, weight, eps):
    return _raw_table_reason(x, table, index) or _guard_rows(_Norm(weight, eps), x, (_first_row(table, x), residual),
                                                             True)


def _nvrtc_scale_rows_kernel(x, weight, table, index, eps: float) -> torch.Tensor:
    out = x.new_empty(x.shape)
    _nvrtc_launch(out, None, x, weight, eps, SCALE_ROWS, scale=_table_rows(table), index=index,
                  table_rows=table.shape[0])
    return out


def _nvrtc_gated_residual_rows_kernel(residual, table, index, x, weight, eps: float) -> torch.Tensor:
    out = x.new_empty(x.shape)
    _nvrtc_launch(out, None, x, weight, eps, GATED_RESIDUAL_ROWS, gate=_table_rows(table), residual=residual,
                  index=index, table_rows=table.shape[0])
    return out


_nvrtc.raw_op("_rmsnorm_scale_rows_cuda", "(Tensor x, Tensor weight, Tensor table, Tensor index, float eps) -> Tensor",
              _raw_scale_rows_guard, _nvrtc_scale_rows_kernel)
_nvrtc.raw_op("_rmsnorm_gated_residual_rows_cuda",
              "(Tensor residual, Tensor table, Tensor index, Tensor x, Tensor weight, float eps) -> Tensor",
              _raw_gated_residual_rows_guard, _nvrtc_gated_residual_rows_kernel)

_scale_rows_launch = LazyLauncher(_nvrtc_scale_rows_kernel, "_rmsnorm_scale_rows_cuda")
_gated_residual_rows_launch = LazyLauncher(_nvrtc_gated_residual_rows_kernel, "_rmsnorm_gated_residual_rows_cuda")


def _scale_rows_kernel(norm, x, rows):
    return _scale_rows_launch(x, norm.weight, rows.table(), rows.index(), norm.eps)


def _gated_residual_rows_kernel(norm, residual, rows, x):
    return _gated_residual_rows_launch(residual, rows.table(), rows.index(), x, norm.weight, norm.eps)


def _gated_residual_rows_signature(norm, residual, rows, x):
    return _signature(norm, x)


RMSNORM_SCALE_ROWS = FusedOp(
    "rmsnorm_scale_rows",
    ref=rmsnorm_scale_rows_ref,
    guard=_scale_rows_guard,
    kernel=_scale_rows_kernel,
    # torch.compile: the rows written out, then the registered rmsnorm_scale (the rewritten forward makes no
    # TokenRows while compiling; this is for a caller that does)
    custom_op=lambda norm, x, rows: torch.ops.diffusers_fastpath.rmsnorm_scale.default(x, norm.weight,
                                                                                        rows.materialize(), norm.eps),
    # the norm self-verified as `rmsnorm_scale`'s (the rows exact by construction: values moved)
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)

RMSNORM_GATED_RESIDUAL_ROWS = FusedOp(
    "rmsnorm_gated_residual_rows",
    ref=rmsnorm_gated_residual_rows_ref,
    guard=_gated_residual_rows_guard,
    kernel=_gated_residual_rows_kernel,
    custom_op=lambda norm, residual, rows, x: torch.ops.diffusers_fastpath.rmsnorm_gated_residual.default(
        residual, rows.materialize(), x, norm.weight, norm.eps),
    verify_key=_gated_residual_rows_signature,
    fallback=_rmsnorm_gated_residual_rows_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def rmsnorm_scale_rows(norm, x, scale, site: Site | None = None) -> torch.Tensor:
    """``norm(x) * scale`` where `scale` may be `TokenRows` (Bria FIBO 2's and Z-Image's ``select_per_token`` rows:
    the kernel reads each token's row of the ``[2B, D]`` table through the index, never written out), fused and
    bit-identical as `rmsnorm_scale` (self-verified per signature); the guard admits what `rmsnorm_scale`'s admits,
    the table of x's dtype with rows of whole 8-byte quads; the fallback writes the rows out with the model's
    function. A tensor scale is `rmsnorm_scale`'s.

    Args:
        norm: the diffusers ``RMSNorm`` module.
        x: ``[B, S, D]`` activations (contiguous for the kernel).
        scale: `TokenRows` of ``[B, S, D]``, or a tensor.
        site: the call site's counters (`rmsnorm_scale`'s site counts both forms).
    """
    if type(scale) is not TokenRows:
        return rmsnorm_scale(norm, x, scale, site)
    return RMSNORM_SCALE_ROWS(site, norm, x, scale)


def rmsnorm_gated_residual_rows(norm, residual, gate, x, site: Site | None = None) -> torch.Tensor:
    """``residual + gate * norm(x)`` where `gate` may be `TokenRows` (read through the index as in
    `rmsnorm_scale_rows`), fused and bit-identical as `rmsnorm_gated_residual`; where the norm cannot run fused,
    it runs as written and the gated residual is the exact fused `gated_residual` of the rows written out. A tensor
    gate is `rmsnorm_gated_residual`'s."""
    if type(gate) is not TokenRows:
        return rmsnorm_gated_residual(norm, residual, gate, x, site)
    return RMSNORM_GATED_RESIDUAL_ROWS(site, norm, residual, gate, x)
