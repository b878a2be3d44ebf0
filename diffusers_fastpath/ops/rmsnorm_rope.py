"""A QK norm (diffusers' ``RMSNorm`` over each head) and the rotary embedding after it, in one pass: the complex form
(`rmsnorm_rope_complex`: Qwen-Image's ``attn.norm_q(q)`` then ``apply_rotary_emb_qwen(q, freqs, use_real=False)``,
Z-Image's processor-local equivalent) and the real form (`rmsnorm_rope_real`: HunyuanVideo-1.5's, Bria-FIBO's
single blocks': ``apply_rotary_emb(norm(q), (cos, sin), sequence_dim=1)``).

The eager chain, T = bf16 or fp16, ``x`` a ``[B, S, H, D]`` q or k, ``freqs`` complex64 ``[S, D/2]`` (or ``[B, S,
D/2]``; complex128 in Lumina2, whose table diffusers builds in float64), broadcast over the heads::

    y = norm(x)                                                   # diffusers RMSNorm: see rmsnorm_scale_shift.py
    z = torch.view_as_complex(y.float().reshape(B, S, H, D // 2, 2)) * freqs.unsqueeze(-2)
    out = torch.view_as_real(z).flatten(3).type_as(y)

The kernel is ``csrc/rmsnorm_scale_shift.cu``'s, with the ``kRopeComplex`` epilogue: the norm in aten's reduction
order (each [D] row of the ``[B * S * H, D]`` view is one warp's row; on the H200 with torch 2.11 the order of the
longer rows also matched aten's ``mean`` on every one of 98304 rows of 128, ``tools/reduction_order_probe.py
--dim 128``), then the complex multiply as aten's ``c10::complex`` operator rounds it there (``real = fma(a, c,
-(b * d))``, ``imag = fma(a, d, b * c)``: ``tools/complex_rotary_probe.py``, 100% of elements). With complex128
factors aten promotes the product to complex128: the same placement in double (100% of elements, ``--complex128``),
then ``.type_as`` rounds double -> float -> T. Rows shorter than 128 (Lumina2's head_dim 96) take aten's scalar
reduction order, as `diffusers_fastpath.ops.rmsnorm` does. All of this is a property of the aten build, so the op
verifies itself: the first fast call of each (dtype, D, factor dtype) is compared with eager by ``torch.equal``; a
mismatch disables it for the process with one warning and runs the eager chain.

The guard admits D = 128 and D a multiple of 4 in [32, 128), a contiguous ``x`` of at least 16 rows, freqs of
complex64 or complex128 whose rows are the tokens (unit innermost stride), the norm diffusers' ``RMSNorm`` (or
``FastpathRMSNorm``) with a ``[D]`` weight of ``x``'s dtype and no bias, no autograd.
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FusedOp, Site
from .rmsnorm_scale_shift import ROPE_COMPLEX, ROPE_COMPLEX128, ROPE_REAL, _Norm, _nvrtc_launch, _rms_norm, norm_reason
from .rotary import cos_sin_reason, rotary_emb, rotary_emb_ref

HEAD_DIM = 128  # the real form's row length (HunyuanVideo-1.5's)
_FACTORS = (torch.complex64, torch.complex128)  # the complex form's factor dtypes (complex128: Lumina2's table)


def _dim_ok(dim: int) -> bool:
    """The complex form's row lengths: 128 (one quad per lane) and the rows that aten reduces in its scalar order."""
    return dim == 128 or (32 <= dim < 128 and dim % 4 == 0)


def rope_complex(y: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's ``apply_rotary_emb_qwen(y, freqs, use_real=False)`` (and diffusers' complex form), written for
    ``[B, S, H, D]`` and freqs of ``[S, D/2]`` or ``[B, S, D/2]``."""
    z = torch.view_as_complex(y.float().reshape(*y.shape[:-1], -1, 2)) * freqs.unsqueeze(-2)
    return torch.view_as_real(z).flatten(3).type_as(y)


def rmsnorm_rope_complex_ref(norm, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The eager chain, through the ``RMSNorm`` module itself."""
    return rope_complex(norm(x), freqs)


def _rows_reason(norm, x: torch.Tensor) -> str | None:
    """What both ops need of the norm and of ``x``'s rows (the parts of the guard before the rotary operands)."""
    reason = norm_reason(norm, x)
    if reason is not None:
        return reason
    if x.dim() != 4:
        return "shape"
    return None


def _guard(norm, x: torch.Tensor, freqs: torch.Tensor, check_pointers: bool = True) -> str | None:
    reason = _rows_reason(norm, x)
    if reason is not None:
        return reason
    if freqs.dim() not in (2, 3) or freqs.dtype not in _FACTORS:
        return "shape"
    batch, tokens, heads, dim = x.shape
    if tuple(freqs.shape[-2:]) != (tokens, dim // 2) or (freqs.dim() == 3 and freqs.shape[0] not in (1, batch)):
        return "shape"
    if freqs.stride(-1) != 1:
        return "freqs strided"
    if not _dim_ok(x.shape[3]):
        return "D outside the reproduced reduction"
    return _layout_reason(norm, x, (freqs,), check_pointers)


def _layout_reason(norm, x: torch.Tensor, tables, check_pointers: bool) -> str | None:
    """The rest of both guards: the row count, contiguity, autograd, devices, alignment."""
    weight = norm.weight
    batch, tokens, heads, dim = x.shape
    rows = batch * tokens * heads
    if rows < 16:
        return "fewer than 16 rows"
    if rows * dim * 4 >= 2**31:
        return "too large for aten's 32-bit reduction"
    if not x.is_contiguous():
        return "x not contiguous"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or any(t.requires_grad for t in tables)):
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if weight.device != x.device or any(t.device != x.device for t in tables):
        return "devices differ"
    align = 16 if any(t.dtype is torch.complex128 for t in tables) else 8  # a complex128 factor: one 16-byte load
    if check_pointers and (x.data_ptr() % 8 or weight.data_ptr() % 8 or any(t.data_ptr() % align for t in tables)):
        return f"not {align}-byte aligned"
    return None


def _pairs(freqs: torch.Tensor) -> torch.Tensor:
    """The float32 (complex128: float64) ``[batch or 1, tokens, dim]`` view of the complex factors (a pair per two
    floats), no copy."""
    real = torch.view_as_real(freqs).flatten(-2)
    return real if real.dim() == 3 else real.unsqueeze(0)


# The NVRTC way: rmsnorm_scale_shift.py's launcher of the shared kernel with the kRopeComplex epilogue (complex128
# factors: kRopeComplex128); duplicated from bindings_norms.cpp's rmsnorm_rope_complex: the rows view, the pair strides
# (in pairs; 0 where freqs broadcast over the batch), the epilogue by the factors' dtype and the output allocation.
def _nvrtc_kernel(x, weight, freqs, heads: int, tokens: int, eps: float, out=None) -> torch.Tensor:
    out = x.new_empty(x.shape) if out is None else out
    pairs = (freqs.data_ptr(), freqs.stride(1) // 2, 0 if freqs.shape[0] == 1 else freqs.stride(0) // 2)
    epilogue = ROPE_COMPLEX128 if freqs.dtype is torch.float64 else ROPE_COMPLEX
    _nvrtc_launch(out, None, x, weight, eps, epilogue, freqs=pairs, heads=heads, tokens=tokens)
    return out


def _raw_guard(x, weight, freqs, heads, tokens, eps):
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[0] % (heads * tokens) or freqs.dim() != 3:
        return "shape"
    view = x.view(x.shape[0] // (heads * tokens), tokens, heads, x.shape[2])
    real = freqs.dtype in (torch.float32, torch.float64)
    as_complex = torch.view_as_complex(freqs.unflatten(-1, (-1, 2))) if real else freqs
    return _guard(_Norm(weight, eps), view, as_complex)


_nvrtc.raw_op("_rmsnorm_rope_complex_cuda",
              "(Tensor x, Tensor weight, Tensor freqs, int heads, int tokens, float eps) -> Tensor",
              _raw_guard, _nvrtc_kernel)
_nvrtc.raw_op("_rmsnorm_rope_complex_cuda_out",
              "(Tensor(a!) out, Tensor x, Tensor weight, Tensor freqs, int heads, int tokens, float eps) -> ()",
              _raw_guard, _nvrtc_kernel, outs=1)


def _nvrtc_out(out, x, weight, freqs, heads: int, tokens: int, eps: float) -> None:
    """The ``_out`` raw op's argument order, for `launcher`."""
    _nvrtc_kernel(x, weight, freqs, heads, tokens, eps, out=out)


_launch = LazyLauncher(_nvrtc_kernel, "_rmsnorm_rope_complex_cuda")
_launch_out = LazyLauncher(_nvrtc_out, "_rmsnorm_rope_complex_cuda_out")


def _kernel(norm, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    batch, tokens, heads, dim = x.shape
    out = _launch(x.view(batch * tokens * heads, 1, dim), norm.weight, _pairs(freqs), heads, tokens, norm.eps)
    return out.view(x.shape)


@torch.library.custom_op("diffusers_fastpath::rmsnorm_rope_complex", mutates_args=())
def _rmsnorm_rope_complex_op(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, eps: float) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _guard(norm, x, freqs) is None:
        return _kernel(norm, x, freqs)
    return rope_complex(_rms_norm(x, weight, eps), freqs).contiguous()


@_rmsnorm_rope_complex_op.register_fake
def _(x, weight, freqs, eps):
    torch._check(x.dim() == 4, lambda: "rmsnorm_rope_complex: x must be [batch, tokens, heads, dim]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _custom_op(norm, x, freqs):
    return torch.ops.diffusers_fastpath.rmsnorm_rope_complex.default(x, norm.weight, freqs, norm.eps)


def _signature(norm, x, freqs):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1], str(freqs.dtype).removeprefix("torch."))


RMSNORM_ROPE_COMPLEX = FusedOp(
    "rmsnorm_rope_complex",
    ref=rmsnorm_rope_complex_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=_custom_op,
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def rmsnorm_rope_complex(norm, x: torch.Tensor, freqs: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``rope_complex(norm(x), freqs)`` (diffusers' ``RMSNorm`` over each head, then the complex-form rotary
    embedding), fused on CUDA (self-verified) and bit-identical to eager everywhere.

    Args:
        norm: a diffusers ``RMSNorm`` (weight, no bias), e.g. ``attn.norm_q``.
        x: ``[B, S, H, D]`` q or k of one stream.
        freqs: complex64 (or complex128) ``[S, D/2]`` or ``[B, S, D/2]`` rotation factors (broadcast over the heads).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers.models.normalization import RMSNorm
        >>> from diffusers_fastpath.ops import rmsnorm_rope_complex, rmsnorm_rope_complex_ref
        >>> norm, x = RMSNorm(128, eps=1e-6), torch.randn(1, 8, 2, 128)
        >>> freqs = torch.polar(torch.ones(8, 64), torch.rand(8, 64))
        >>> torch.equal(rmsnorm_rope_complex(norm, x, freqs), rmsnorm_rope_complex_ref(norm, x, freqs))
        True
    """
    return RMSNORM_ROPE_COMPLEX(site, norm, x, freqs)


# --- the two streams' q (or k) rotated into their joint concatenation ----------------------------------------------
# Qwen-Image's processor: ``joint = torch.cat([rope(norm_txt(x_txt), f_txt), rope(norm_img(x_img), f_img)], dim=1)``;
# the kernel writes each stream's rows into its slice of the joint tensor (at batch 1 each slice is contiguous), so
# the concatenation's copy of both (of the 2.9 ms a Qwen-Image step at 1024x1024 spends concatenating q, k and v)
# is not made for q and k.


def rmsnorm_rope_complex_cat_ref(norm_a, x_a, freqs_a, norm_b, x_b, freqs_b, single_site=None) -> torch.Tensor:
    """The eager chain: both streams' norm and rotary, then ``torch.cat([a, b], dim=1)``."""
    return torch.cat([rmsnorm_rope_complex_ref(norm_a, x_a, freqs_a), rmsnorm_rope_complex_ref(norm_b, x_b, freqs_b)],
                     dim=1)


def _cat_fallback(norm_a, x_a, freqs_a, norm_b, x_b, freqs_b, single_site=None) -> torch.Tensor:
    # each stream through the single op (fused and self-verified on its own where it can), then the concatenation
    return torch.cat([rmsnorm_rope_complex(norm_a, x_a, freqs_a, single_site),
                      rmsnorm_rope_complex(norm_b, x_b, freqs_b, single_site)], dim=1)


def _cat_guard(norm_a, x_a, freqs_a, norm_b, x_b, freqs_b, single_site=None, check_pointers: bool = True):
    if x_a.dim() != 4 or x_b.dim() != 4:
        return "shape"
    if x_a.shape[0] != 1 or x_b.shape[0] != 1:
        return "batch above 1 (the streams' slices of the joint tensor are strided)"
    if x_a.shape[2:] != x_b.shape[2:] or x_a.dtype != x_b.dtype or x_a.device != x_b.device:
        return "streams of different heads, dtypes or devices"
    for norm, x, freqs in ((norm_a, x_a, freqs_a), (norm_b, x_b, freqs_b)):
        reason = _guard(norm, x, freqs, check_pointers)
        if reason is not None:
            return reason
    return None


def _cat_kernel(norm_a, x_a, freqs_a, norm_b, x_b, freqs_b, single_site=None) -> torch.Tensor:
    _, tokens_a, heads, dim = x_a.shape
    out = x_a.new_empty(1, tokens_a + x_b.shape[1], heads, dim)
    for norm, x, freqs, part in ((norm_a, x_a, freqs_a, out[:, :tokens_a]), (norm_b, x_b, freqs_b, out[:, tokens_a:])):
        rows = x.shape[1] * heads  # batch 1: `part` is a contiguous [tokens, heads, dim] block of `out`
        _launch_out(part.view(rows, 1, dim), x.view(rows, 1, dim), norm.weight, _pairs(freqs), heads, x.shape[1],
                    norm.eps)
    return out


@torch.library.custom_op("diffusers_fastpath::rmsnorm_rope_complex_cat", mutates_args=())
def _rmsnorm_rope_complex_cat_op(x_a: torch.Tensor, weight_a: torch.Tensor, freqs_a: torch.Tensor, eps_a: float,
                                 x_b: torch.Tensor, weight_b: torch.Tensor, freqs_b: torch.Tensor,
                                 eps_b: float) -> torch.Tensor:
    args = (_Norm(weight_a, eps_a), x_a, freqs_a, _Norm(weight_b, eps_b), x_b, freqs_b)
    if _cat_guard(*args) is None:
        return _cat_kernel(*args)
    return torch.cat([_rmsnorm_rope_complex_op(x_a, weight_a, freqs_a, eps_a),
                      _rmsnorm_rope_complex_op(x_b, weight_b, freqs_b, eps_b)], dim=1)  # each stream's own op


@_rmsnorm_rope_complex_cat_op.register_fake
def _(x_a, weight_a, freqs_a, eps_a, x_b, weight_b, freqs_b, eps_b):
    torch._check(x_a.dim() == 4 and x_b.dim() == 4, lambda: "rmsnorm_rope_complex_cat: x must be [B, S, H, D]")
    return x_a.new_empty(x_a.shape[0], x_a.shape[1] + x_b.shape[1], *x_a.shape[2:])


def _cat_custom_op(norm_a, x_a, freqs_a, norm_b, x_b, freqs_b, single_site=None):
    return torch.ops.diffusers_fastpath.rmsnorm_rope_complex_cat.default(x_a, norm_a.weight, freqs_a, norm_a.eps, x_b,
                                                                         norm_b.weight, freqs_b, norm_b.eps)


def _cat_signature(norm_a, x_a, freqs_a, norm_b, x_b, freqs_b, single_site=None):
    return (str(x_a.dtype).removeprefix("torch."), x_a.shape[-1])


RMSNORM_ROPE_COMPLEX_CAT = FusedOp(
    "rmsnorm_rope_complex_cat",
    ref=rmsnorm_rope_complex_cat_ref,
    guard=_cat_guard,
    kernel=_cat_kernel,
    custom_op=_cat_custom_op,
    verify_key=_cat_signature,
    fallback=_cat_fallback,
    modules=(0, 3),  # the norms whose calls the kernel stands for: their hooks refuse the call
)


def rmsnorm_rope_complex_cat(norm_a, x_a: torch.Tensor, freqs_a: torch.Tensor, norm_b, x_b: torch.Tensor,
                             freqs_b: torch.Tensor, site: Site | None = None,
                             single_site: Site | None = None) -> torch.Tensor:
    """``torch.cat([rope_complex(norm_a(x_a), freqs_a), rope_complex(norm_b(x_b), freqs_b)], dim=1)``: two streams'
    QK norm and complex rotary (Qwen-Image's text and image q, or k) written into their joint tensor by the
    `rmsnorm_rope_complex` kernel, self-verified per (dtype, D) the same way, bit-identical to eager everywhere.

    Args:
        norm_a, x_a, freqs_a: the first stream's diffusers ``RMSNorm``, ``[1, S_a, H, D]`` q or k, complex64 factors.
        norm_b, x_b, freqs_b: the second stream's (the same H, D, dtype and device).
        site: the call site's counters; `single_site`: where each stream's own `rmsnorm_rope_complex` counts when the
            joint kernel cannot take them (a batch above 1, say) and they run one by one.

    Example:
        >>> import torch
        >>> from diffusers.models.normalization import RMSNorm
        >>> from diffusers_fastpath.ops import rmsnorm_rope_complex_cat, rmsnorm_rope_complex_cat_ref
        >>> norm, x_a, x_b = RMSNorm(128, eps=1e-6), torch.randn(1, 3, 2, 128), torch.randn(1, 8, 2, 128)
        >>> f_a, f_b = (torch.polar(torch.ones(n, 64), torch.rand(n, 64)) for n in (3, 8))
        >>> out = rmsnorm_rope_complex_cat(norm, x_a, f_a, norm, x_b, f_b)
        >>> out.shape, torch.equal(out, rmsnorm_rope_complex_cat_ref(norm, x_a, f_a, norm, x_b, f_b))
        (torch.Size([1, 11, 2, 128]), True)
    """
    return RMSNORM_ROPE_COMPLEX_CAT(site, norm_a, x_a, freqs_a, norm_b, x_b, freqs_b, single_site)


# --- the real form: diffusers' apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1) -------------------------------


def rmsnorm_rope_real_ref(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_site=None) -> torch.Tensor:
    """The eager chain, through the ``RMSNorm`` module and diffusers' ``apply_rotary_emb`` themselves."""
    return rotary_emb_ref(norm(x), cos, sin)


def _real_fallback(norm, x, cos, sin, rope_site=None) -> torch.Tensor:
    # the norm as written, the rotary still the exact fused one (counted on its own site)
    return rotary_emb(norm(x), cos, sin, rope_site)


def _real_guard(norm, x, cos, sin, rope_site=None, check_pointers: bool = True) -> str | None:
    reason = _rows_reason(norm, x)
    if reason is None:
        reason = cos_sin_reason(cos, sin, x.shape[1], x.shape[3], x.device, check_pointers)
    if reason is None and x.shape[3] != HEAD_DIM:
        reason = "D outside the reproduced reduction"
    return reason if reason is not None else _layout_reason(norm, x, (cos, sin), check_pointers)


def _nvrtc_real_kernel(x, weight, cos, sin, heads: int, tokens: int, eps: float, out=None) -> torch.Tensor:
    out = x.new_empty(x.shape) if out is None else out
    _nvrtc_launch(out, None, x, weight, eps, ROPE_REAL, freqs=(cos.data_ptr(), cos.stride(0), 0), heads=heads,
                  tokens=tokens, sin=(sin.data_ptr(), sin.stride(0), 0))
    return out


def _raw_real_guard(x, weight, cos, sin, heads, tokens, eps):
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[0] % (heads * tokens):
        return "shape"
    return _real_guard(_Norm(weight, eps), x.view(x.shape[0] // (heads * tokens), tokens, heads, x.shape[2]), cos, sin,
                       None)


_nvrtc.raw_op("_rmsnorm_rope_real_cuda",
              "(Tensor x, Tensor weight, Tensor cos, Tensor sin, int heads, int tokens, float eps) -> Tensor",
              _raw_real_guard, _nvrtc_real_kernel)

_real_launch = LazyLauncher(_nvrtc_real_kernel, "_rmsnorm_rope_real_cuda")


def _real_kernel(norm, x, cos, sin, rope_site=None) -> torch.Tensor:
    batch, tokens, heads, dim = x.shape
    return _real_launch(x.view(-1, 1, dim), norm.weight, cos, sin, heads, tokens, norm.eps).view(x.shape)


@torch.library.custom_op("diffusers_fastpath::rmsnorm_rope_real", mutates_args=())
def _rmsnorm_rope_real_op(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          eps: float) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _real_guard(norm, x, cos, sin) is None:
        return _real_kernel(norm, x, cos, sin)
    return rotary_emb_ref(_rms_norm(x, weight, eps), cos, sin).contiguous()


@_rmsnorm_rope_real_op.register_fake
def _(x, weight, cos, sin, eps):
    torch._check(x.dim() == 4, lambda: "rmsnorm_rope_real: x must be [batch, tokens, heads, dim]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


RMSNORM_ROPE_REAL = FusedOp(
    "rmsnorm_rope_real",
    ref=rmsnorm_rope_real_ref,
    guard=_real_guard,
    kernel=_real_kernel,
    custom_op=lambda norm, x, cos, sin, rope_site=None: torch.ops.diffusers_fastpath.rmsnorm_rope_real.default(
        x, norm.weight, cos, sin, norm.eps),
    verify_key=lambda norm, x, cos, sin, rope_site=None: (str(x.dtype).removeprefix("torch."), x.shape[-1]),
    fallback=_real_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def rmsnorm_rope_real(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: Site | None = None,
                      rope_site: Site | None = None) -> torch.Tensor:
    """``apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1)`` (diffusers' ``RMSNorm`` over each head, then the
    real-form rotary embedding with FLUX-style tables), fused on CUDA (the norm self-verified, the rotary exact by
    construction as in `rotary_emb`) and bit-identical to eager everywhere.

    Args:
        norm: a diffusers ``RMSNorm`` (weight, no bias), e.g. ``attn.norm_q``.
        x: ``[B, S, H, D]`` q or k.
        cos, sin: float32 ``[S, D]`` tables (diffusers' ``get_1d_rotary_pos_embed(..., use_real=True)`` layout).
        site: the call site's counters, shown by `diffusers_fastpath.report`; ``rope_site``: those of the fused
            `rotary_emb` that runs after the norm where the norm cannot be fused (the guard said why).
    """
    return RMSNORM_ROPE_REAL(site, norm, x, cos, sin, rope_site)
