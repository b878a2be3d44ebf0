"""diffusers' rotary embedding, ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)``, in one pass over ``x``.

Formula and rounding points (T the storage dtype, fp16 or bf16; ``cos``/``sin`` fp32 ``[S, D]``), exactly those of
the eager chain ``(x.float() * cos + x_rotated.float() * sin).to(T)`` with ``x_rotated`` the pairs ``(-x[2i+1],
x[2i])``::

    out[2i]   = round(x[2i] * cos[2i] + (-x[2i+1]) * sin[2i])
    out[2i+1] = round(x[2i+1] * cos[2i+1] + x[2i] * sin[2i+1])

each product and the sum a separate fp32 operation (no FMA), so the result is ``torch.equal`` to eager on any input,
NaN, inf and signed zeros included: exact by construction, no self-verification. Eager runs eight kernels for this
(306.7 µs per call on (1, 4608, 24, 128) bf16 on an H200); the fused kernel reads ``x`` and the cos/sin rows once
and writes the output once. Shapes: ``x`` is ``[B, S, H, D]`` (any strides with a unit innermost one and 8-byte
aligned rows, D a multiple of 4), ``cos``/``sin`` contiguous ``[S, D]``; no autograd (of x or the tables). The
kernel's result is contiguous, eager's is laid out after x (TensorIterator orders its dimensions by x's strides), so
the fused ops (this one, the rows and Wan forms below) take x only where eager's result is contiguous too: x
contiguous or a slice in its own order (a fused projection's chunk), not a permuted view
(`_policy.laid_out_contiguous`). The kernel is ``csrc/rotary.cu``, shared with `qk_norm_rope`, which fuses the QK
RMSNorm in front of it.

Eager calls reach ``diffusers_fastpath::_rotary_emb_cuda`` directly; ``torch.compile`` sees the custom op
``diffusers_fastpath::rotary_emb``.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, REASON_LAYOUT, FusedOp, Site, laid_out_contiguous


def rotary_emb_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The eager expression: diffusers' own ``apply_rotary_emb`` as FLUX calls it."""
    return apply_rotary_emb(x, (cos, sin), sequence_dim=1)


def rows_ok(x: torch.Tensor) -> bool:
    """``[B, S, H, D]`` with unit innermost stride and every row start a multiple of 4 elements (8 bytes in T)."""
    return x.stride(3) == 1 and x.stride(0) % 4 == 0 and x.stride(1) % 4 == 0 and x.stride(2) % 4 == 0


def cos_sin_reason(cos: torch.Tensor, sin: torch.Tensor, seq: int, dim: int, device, check_pointers: bool) -> str | None:
    """Why the kernel cannot read these cos/sin tables for a ``[.., seq, .., dim]`` output, or None (tables that
    record a gradient under grad mode included)."""
    if cos.dtype is not torch.float32 or sin.dtype is not torch.float32:
        return "cos/sin not float32"
    if cos.shape != (seq, dim) or sin.shape != (seq, dim):
        return "shape"
    if not (cos.is_contiguous() and sin.is_contiguous()):
        return "cos/sin strided"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "requires grad"  # eager's result then records the tables' gradient; the kernel's records nothing
    if cos.device != device or sin.device != device:
        return "devices differ"
    if check_pointers and (cos.data_ptr() % 16 or sin.data_ptr() % 16):
        return "cos/sin not 16-byte aligned"
    return None


def _x_reason(x: torch.Tensor) -> str | None:
    """Why the kernel cannot take ``[B, S, H, D]`` queries or keys `x` (of a half dtype), or None."""
    if x.shape[3] % 4:
        return "D not a multiple of 4"
    if x.numel() == 0:
        return "empty"
    if x.shape[0] > 65535:
        return "batch above 65535"
    if not rows_ok(x):
        return "x strided"
    if torch.is_grad_enabled() and x.requires_grad:
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    return None


def _guard(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, check_pointers: bool = True,
           eager_layout: bool = False) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site).
    `eager_layout`: only where eager's result is contiguous, as the kernel's (the fused op's question; the raw op's
    contract is a contiguous result whatever x's layout)."""
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if x.dim() != 4 or cos.dim() != 2 or sin.dim() != 2:
        return "shape"
    if eager_layout and not laid_out_contiguous(x):
        return REASON_LAYOUT  # eager's result keeps x's order of dimensions (`laid_out_contiguous`)
    reason = _x_reason(x)
    if reason is not None:
        return reason
    _, seq, _, dim = x.shape
    reason = cos_sin_reason(cos, sin, seq, dim, x.device, check_pointers)
    if reason is None and check_pointers and x.data_ptr() % 8:
        return "not 8-byte aligned"
    return reason


# The NVRTC way (ops/_nvrtc.py): csrc/rotary.cu's kernel (also qk_norm_rope's, with norm), launched as its launch()
# and bindings.cpp's rotary_launch do: one block of kThreads 256 per (sequence position, batch) (tests/test_nvrtc.py
# reads it from the .cu). Duplicated from there: that shape, the RotaryArgs and RotarySource fields (fastpath.h), a
# source as (pointer, stride(0), stride(1), stride(2), size(1), weight, eps as static_cast<float>), an absent text part
# as zeros and the output allocation; the guards stand for bindings.cpp's input checks.
_SOURCE = _nvrtc.Params("RotarySource", ("ptr", "P"), ("stride_b", "q"), ("stride_s", "q"), ("stride_h", "q"),
                        ("seq", "q"), ("weight", "P"), ("eps", "f"))
_ARGS = _nvrtc.Params("RotaryArgs", ("out", "P"), ("txt", _SOURCE), ("img", _SOURCE), ("cos", "P"), ("sin", "P"),
                      ("cos_stride_b", "q"), ("cos_stride_s", "q"), ("cos_stride_h", "q"), ("batch", "q"),
                      ("heads", "q"), ("dim", "q"), ("norm", "?"), ("wan", "?"), ("norm_rows", "?"), ("norm_fp32", "?"),
                      ("norm_f32w", "?"), ("dtype", "i"), ("norm_final", "i"), ("mod_scale", "P"), ("mod_shift", "P"),
                      ("mod_scale_stride_b", "q"), ("mod_shift_stride_b", "q"), ("mod_index", "P"),
                      ("mod_table_rows", "q"))
_NVRTC = _nvrtc.Kernel(
    "rotary.cu",
    "diffusers_fastpath::rotary_kernel",
    # (dtype, norm, form): rotary.cu's kNoNorm 0, kHeadNorm 1, kHeadNormF32 2 (FLUX.3), kHeadNormF32W 3 (Krea 2); kShared 0,
    # kPerHead 1 (LTX-Video's tables), kWan 2 (Wan's pairing)
    {(dtype, norm, form): f"{_nvrtc.STORAGE_TYPE[dtype]}, {norm}, {form}"
     for dtype in HALF_DTYPES for norm, form in ((0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (0, 2))},
    _nvrtc.Params("rotary_kernel", ("a", _ARGS)),
)
# The row norm's kernel (qk_norm_rows_rope): one block of kRowThreads 128 per row, forms kPerHead 1 and kWan 2, and
# the pair (kPerHead only: LTX-Video's q and k); kNoRotary 3, the norm alone with a float32 weight
# (zero_centred_rmsnorm), and kNoRotaryModulate 4, with the modulate after it (zero_centred_modulate); kNormModulateRows
# 5, torch.nn.RMSNorm with the modulate of rows read through an index (rms_norm_modulate_rows).
_NVRTC_ROWS = _nvrtc.Kernel(
    "rotary.cu",
    "diffusers_fastpath::row_norm_rotary_kernel",
    {(dtype, form, pair): f"{_nvrtc.STORAGE_TYPE[dtype]}, {form}, {str(pair).lower()}"
     for dtype in HALF_DTYPES
     for form, pair in ((1, False), (2, False), (1, True), (3, False), (4, False), (5, False))},
    _nvrtc.Params("row_norm_rotary_kernel", ("a", _ARGS)),
)
# The norm-only forms (3, 4, 5 above) on rows of at most _NARROW_WIDEST elements: narrow_row_norm_kernel, a warp a row,
# _NARROW_ROWS_PER_BLOCK consecutive rows a block of _NARROW_THREADS, one grid dimension (rotary.cu's launch()).
_NVRTC_NARROW_ROWS = _nvrtc.Kernel(
    "rotary.cu",
    "diffusers_fastpath::narrow_row_norm_kernel",
    {(dtype, form): f"{_nvrtc.STORAGE_TYPE[dtype]}, {form}" for dtype in HALF_DTYPES for form in (3, 4, 5)},
    _nvrtc.Params("narrow_row_norm_kernel", ("a", _ARGS)),
)
_NARROW_THREADS = 256  # rotary.cu's kNarrowWarps * 32
_NARROW_ROWS_PER_BLOCK = 32  # ... kNarrowRowsPerBlock
_NARROW_WIDEST = 128  # ... kNarrowWidest
# The shared-table form at dim 128, with the per-head norm (FLUX's; FLUX.3's fp32 one, 2; Krea 2's, 3) or without:
# head_norm_rotary_kernel, (dtype, norm), kHeadThreads 128 a row.
_NVRTC_HEADS = _nvrtc.Kernel(
    "rotary.cu",
    "diffusers_fastpath::head_norm_rotary_kernel",
    {(dtype, norm): f"{_nvrtc.STORAGE_TYPE[dtype]}, {norm}" for dtype in HALF_DTYPES for norm in (0, 1, 2, 3)},
    _nvrtc.Params("head_norm_rotary_kernel", ("a", _ARGS)),
)
_ROW_THREADS = 128
_THREADS = 256
_HEAD_THREADS = 128
_HEAD_DIM = 128
_NO_SOURCE = (0, 0, 0, 0, 0, 0, 0.0)
_NO_MODULATE = (0, 0, 0, 0, 0, 0)  # RotaryArgs' mod_* fields: no modulate after the row norm


def nvrtc_rotary(x_txt, weight_txt, eps_txt, x_img, weight_img, eps_img, cos, sin, norm: bool, out=None,
                 wan: bool = False, norm_rows: bool = False, norm_final: int = 0,
                 norm_fp32: bool = False, norm_f32w: bool = False) -> torch.Tensor:
    """rotary_launch of bindings.cpp on the NVRTC way: [txt; img] rotated (after the RMSNorm of each head when
    ``norm``, of each row of ``x_img`` when ``norm_rows``); with ``norm_rows`` and ``x_txt``, qk_norm_rows_rope_pair's
    q (``x_img``) and k (``x_txt``) into one ``[2, B, S, H, D]`` result; with ``norm`` and ``norm_fp32``, FLUX.3's
    float32 norm and rotary, rounded once; with ``norm_f32w``, Krea 2's float32 weight with the norm rounded."""
    batch, seq_img, heads, dim = x_img.shape
    pair = norm_rows and x_txt is not None
    seq = seq_img + (0 if x_txt is None or pair else x_txt.shape[1])
    shape = (2, batch, seq, heads, dim) if pair else (batch, seq, heads, dim)
    if out is None:
        out = x_img.new_empty(shape)
    else:
        _nvrtc.check_out("rotary", out, shape, x_img, 8)
    normed = norm or norm_rows
    txt = _NO_SOURCE if x_txt is None else (x_txt.data_ptr(), *x_txt.stride()[:3], x_txt.shape[1],
                                            weight_txt.data_ptr() if normed else 0, eps_txt if normed else 0.0)
    img = (x_img.data_ptr(), *x_img.stride()[:3], seq_img, weight_img.data_ptr() if normed else 0,
           eps_img if normed else 0.0)
    # bindings.cpp's table strides: [seq, dim] for every head and sample, or [batch or 1, seq, heads * dim] rows
    rows = cos.dim() == 3
    strides = ((0 if cos.shape[0] == 1 else seq * heads * dim), heads * dim, dim) if rows else (0, dim, 0)
    args = (out.data_ptr(), *txt, *img, cos.data_ptr(), sin.data_ptr(), *strides, batch, heads, dim, norm, wan,
            norm_rows, norm_fp32, norm_f32w, _nvrtc.DTYPE_CODE[x_img.dtype], norm_final, *_NO_MODULATE)
    norm_form = 2 if norm_fp32 else 3 if norm_f32w else int(norm)  # kHeadNormF32, kHeadNormF32W, kHeadNorm, kNoNorm
    if norm_rows:
        _NVRTC_ROWS.launch(x_img.device.index, (x_img.dtype, 2 if wan else 1, pair), (seq, batch, 1),
                           (_ROW_THREADS, 1, 1), *args)
    elif dim == _HEAD_DIM and not rows and not wan:
        _NVRTC_HEADS.launch(x_img.device.index, (x_img.dtype, norm_form), (seq, batch, 1), (_HEAD_THREADS, 1, 1),
                            *args)
    else:
        _NVRTC.launch(x_img.device.index, (x_img.dtype, norm_form, 2 if wan else int(rows)), (seq, batch, 1),
                      (_THREADS, 1, 1), *args)
    return out


def _nvrtc_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return nvrtc_rotary(None, None, 0.0, x, None, 0.0, cos, sin, False, out)


_nvrtc.raw_op("_rotary_emb_cuda", "(Tensor x, Tensor cos, Tensor sin) -> Tensor", _guard, _nvrtc_kernel)
_nvrtc.raw_op("_rotary_emb_cuda_out", "(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin) -> ()", _guard, _nvrtc_kernel,
              outs=1)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_rotary_emb_cuda")


def _kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _cuda_op(x, cos, sin)


@torch.library.custom_op("diffusers_fastpath::rotary_emb", mutates_args=())
def _rotary_emb_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Behind torch.compile: the kernel where the guard (with real pointers) allows, the eager expression elsewhere.
    if _guard(x, cos, sin) is None:
        return _kernel(x, cos, sin)
    return rotary_emb_ref(x, cos, sin).contiguous()


@_rotary_emb_op.register_fake
def _rotary_emb_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 4, lambda: f"rotary_emb: x must be [B, S, H, D], got {tuple(x.shape)}")
    torch._check(cos.dim() == 2 and sin.dim() == 2, lambda: "rotary_emb: cos/sin must be [S, D]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _op_guard(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, check_pointers: bool = True) -> str | None:
    """The fused op's guard: `_guard`, for an x whose eager result is contiguous as the kernel's."""
    return _guard(x, cos, sin, check_pointers, eager_layout=True)


ROTARY_EMB = FusedOp(
    "rotary_emb",
    ref=rotary_emb_ref,
    guard=_op_guard,
    kernel=_kernel,
    custom_op=torch.ops.diffusers_fastpath.rotary_emb.default,
)


def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``apply_rotary_emb(x, (cos, sin), sequence_dim=1)``, fused on CUDA and bit-identical to eager everywhere.

    Args:
        x: ``[B, S, H, D]`` queries or keys (fp16/bf16 take the kernel; anything else runs diffusers' function).
        cos, sin: fp32 ``[S, D]`` tables, as ``FluxPosEmbed`` returns them.
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import rotary_emb, rotary_emb_ref
        >>> x, cos, sin = torch.randn(1, 16, 2, 8), torch.randn(16, 8), torch.randn(16, 8)
        >>> torch.equal(rotary_emb(x, cos, sin), rotary_emb_ref(x, cos, sin))
        True
    """
    return ROTARY_EMB(site, x, cos, sin)


# ------------------------------------------------------------------------------------------------ the rows form
# LTX-Video's ``apply_rotary_emb(x, (cos, sin))`` (diffusers.models.transformers.transformer_ltx; its adapter checks the
# installed source by digest): the same expression over ``[B, S, C]`` rows, all heads at once, with fp32 tables of
# ``[B or 1, S, C]`` (one per sample). The kernel is the one above, reading each head's slice of the tables.


def rotary_emb_rows_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The eager expression, as LTX-Video's ``apply_rotary_emb`` writes it (diffusers 0.42.1)."""
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)  # [B, S, C // 2]
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def rows_head_dim(channels: int) -> int:
    """The split of a row into heads for the kernel's warps: any gives the same result (pairs are independent)."""
    return next(d for d in (128, 64, 32, 16, 8, 4) if channels % d == 0)


def guard_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, check_pointers: bool = True,
               eager_layout: bool = False) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site).
    `eager_layout`: only where eager's result is contiguous, as the kernel's (as `_guard`'s)."""
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if x.dim() != 3 or cos.dim() != 3 or sin.dim() != 3:
        return "shape"
    if eager_layout and not laid_out_contiguous(x):
        return REASON_LAYOUT
    batch, seq, channels = x.shape
    if channels % 4:
        return "C not a multiple of 4"
    head_dim = rows_head_dim(channels)
    reason = _x_reason(x.unflatten(2, (channels // head_dim, head_dim)))  # the heads the kernel reads
    if reason is not None:
        return reason
    reason = rows_tables_reason(cos, sin, batch, seq, channels, x.device, check_pointers)
    if reason is None and check_pointers and x.data_ptr() % 8:
        return "not aligned"
    return reason


def rows_tables_reason(cos: torch.Tensor, sin: torch.Tensor, batch: int, seq: int, channels: int, device,
                       check_pointers: bool) -> str | None:
    """Why the kernel cannot read LTX-Video's ``[B or 1, S, C]`` tables for ``[B, S, C]`` rows, or None."""
    if cos.dtype is not torch.float32 or sin.dtype is not torch.float32:
        return "cos/sin not float32"
    if cos.shape != sin.shape or cos.shape[0] not in (1, batch) or tuple(cos.shape[1:]) != (seq, channels):
        return "cos/sin shape"  # eager broadcasts other shapes (a [B, S, C] table of a batch-1 x makes B outputs)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        return "cos/sin strided"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "requires grad"  # eager's result then records the tables' gradient; the kernel's records nothing
    if cos.device != device or sin.device != device:
        return "devices differ"
    if check_pointers and (cos.data_ptr() % 16 or sin.data_ptr() % 16):
        return "not aligned"
    return None


def _nvrtc_kernel_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    heads = x.unflatten(2, (x.shape[2] // head_dim, head_dim))
    return nvrtc_rotary(None, None, 0.0, heads, None, 0.0, cos, sin, False).flatten(2)


_nvrtc.raw_op("_rotary_emb_rows_cuda", "(Tensor x, Tensor cos, Tensor sin, int head_dim) -> Tensor",
              lambda x, cos, sin, head_dim: guard_rows(x, cos, sin), _nvrtc_kernel_rows)

_cuda_rows_op = LazyLauncher(_nvrtc_kernel_rows, "_rotary_emb_rows_cuda")


def _kernel_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _cuda_rows_op(x, cos, sin, rows_head_dim(x.shape[2]))


@torch.library.custom_op("diffusers_fastpath::rotary_emb_rows", mutates_args=())
def _rotary_emb_rows_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if guard_rows(x, cos, sin) is None:
        return _kernel_rows(x, cos, sin)
    return rotary_emb_rows_ref(x, cos, sin).contiguous()


@_rotary_emb_rows_op.register_fake
def _rotary_emb_rows_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 3, lambda: f"rotary_emb_rows: x must be [B, S, C], got {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rows_op_guard(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, check_pointers: bool = True) -> str | None:
    """The fused op's guard: `guard_rows`, for an x whose eager result is contiguous as the kernel's."""
    return guard_rows(x, cos, sin, check_pointers, eager_layout=True)


ROTARY_EMB_ROWS = FusedOp(
    "rotary_emb_rows",
    ref=rotary_emb_rows_ref,
    guard=_rows_op_guard,
    kernel=_kernel_rows,
    custom_op=torch.ops.diffusers_fastpath.rotary_emb_rows.default,
)


def rotary_emb_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """LTX-Video's ``apply_rotary_emb(x, (cos, sin))``, fused on CUDA and bit-identical to eager everywhere.

    Args:
        x: ``[B, S, C]`` queries or keys, all heads in one row (fp16/bf16 take the kernel).
        cos, sin: fp32 ``[B or 1, S, C]`` tables, as ``LTXVideoRotaryPosEmbed`` returns them.
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import rotary_emb_rows, rotary_emb_rows_ref
        >>> x, cos, sin = torch.randn(2, 16, 8), torch.randn(1, 16, 8), torch.randn(1, 16, 8)
        >>> torch.equal(rotary_emb_rows(x, cos, sin), rotary_emb_rows_ref(x, cos, sin))
        True
    """
    return ROTARY_EMB_ROWS(site, x, cos, sin)


# ------------------------------------------------------------------------------------------------ Wan's form
# Wan's ``apply_rotary_emb(x, freqs_cos, freqs_sin)``, the function ``WanAttnProcessor.__call__`` defines (its adapter
# checks that definition's source by digest): x ``[B, S, H, D]``, fp32 tables ``[1, S, 1, D]``, a pairing of its own
# (csrc/rotary.cu's rotate_pair_wan). The kernel is the one above, reading one ``[S, D]`` table for every head.


def rotary_emb_wan_ref(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """The eager expression, as Wan's processor writes it (diffusers 0.42.1)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def guard_wan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, check_pointers: bool = True,
              eager_layout: bool = False) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site).
    `eager_layout`: only where eager's result (``torch.empty_like(x)``) is contiguous, as the kernel's."""
    if x.dim() != 4 or cos.dim() != 4 or sin.dim() != 4:
        return "shape"
    _, seq, _, dim = x.shape
    if cos.shape != (1, seq, 1, dim) or sin.shape != cos.shape:
        return "cos/sin shape"  # other shapes broadcast in eager (a table per sample or per head)
    return _guard(x, cos.view(seq, dim) if cos.is_contiguous() else cos[0, :, 0],
                  sin.view(seq, dim) if sin.is_contiguous() else sin[0, :, 0], check_pointers, eager_layout)


def _nvrtc_kernel_wan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return nvrtc_rotary(None, None, 0.0, x, None, 0.0, cos, sin, False, wan=True)


_nvrtc.raw_op("_rotary_emb_wan_cuda", "(Tensor x, Tensor cos, Tensor sin) -> Tensor", _guard, _nvrtc_kernel_wan)

_cuda_wan_op = LazyLauncher(_nvrtc_kernel_wan, "_rotary_emb_wan_cuda")


def _kernel_wan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    seq, dim = x.shape[1], x.shape[3]
    return _cuda_wan_op(x, cos.view(seq, dim), sin.view(seq, dim))  # the guard checked [1, S, 1, D], contiguous


@torch.library.custom_op("diffusers_fastpath::rotary_emb_wan", mutates_args=())
def _rotary_emb_wan_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if guard_wan(x, cos, sin) is None:
        return _kernel_wan(x, cos, sin)
    return rotary_emb_wan_ref(x, cos, sin).contiguous()


@_rotary_emb_wan_op.register_fake
def _rotary_emb_wan_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 4, lambda: f"rotary_emb_wan: x must be [B, S, H, D], got {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _wan_op_guard(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, check_pointers: bool = True) -> str | None:
    """The fused op's guard: `guard_wan`, for an x whose eager result is contiguous as the kernel's."""
    return guard_wan(x, cos, sin, check_pointers, eager_layout=True)


ROTARY_EMB_WAN = FusedOp(
    "rotary_emb_wan",
    ref=rotary_emb_wan_ref,
    guard=_wan_op_guard,
    kernel=_kernel_wan,
    custom_op=torch.ops.diffusers_fastpath.rotary_emb_wan.default,
)


def rotary_emb_wan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """Wan's rotary embedding (the ``apply_rotary_emb`` its attention processor defines), fused on CUDA and
    bit-identical to eager everywhere.

    Args:
        x: ``[B, S, H, D]`` queries or keys (fp16/bf16 take the kernel).
        cos, sin: fp32 ``[1, S, 1, D]`` tables, as ``WanRotaryPosEmbed`` returns them.
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import rotary_emb_wan, rotary_emb_wan_ref
        >>> x, cos, sin = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 1, 8), torch.randn(1, 16, 1, 8)
        >>> torch.equal(rotary_emb_wan(x, cos, sin), rotary_emb_wan_ref(x, cos, sin))
        True
    """
    return ROTARY_EMB_WAN(site, x, cos, sin)
