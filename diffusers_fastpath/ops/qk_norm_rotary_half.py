"""A QK norm of each head and the rotate-half rotary over the head's first R channels (the rest passed through), in one
pass: MiniMax-H3's attention, and any processor with that form.

Eager (``MiniMaxH3AttnProcessor``; T = bf16 or fp16, ``norm_q``/``norm_k`` ``torch.nn.RMSNorm(D)`` with a weight of T,
x ``[B, S, H, D]``, float32 tables ``[S, R]``, R even, at most D)::

    query = attn.norm_q(query)                        # aten's fused rms_norm per head: y = round(w * (rstd * x))
    query = _apply_rotary_emb(query, cos, sin)        # the model's function: c = round(cos), s = round(sin), then
    #   out[i]       = round(round(y[i] * c[i]) + round(-y[i + R/2] * s[i]))              i < R/2
    #   out[i + R/2] = round(round(y[i + R/2] * c[i + R/2]) + round(y[i] * s[i + R/2]))
    #   out[j]       = y[j]                                                               R <= j < D

(the slices, ``chunk``, the negation and the two ``torch.cat`` are exact: only the products, the sum and the tables'
casts round, each to T, as `rotary_half_partial` computes them). The kernel (``csrc/rotary.cu``,
``head_norm_rotate_half_kernel``) reads x once and writes the result once: the normalised heads are never stored. Its
rotary part is exact by construction; its norm is the per-head order `qk_norm_rope` reproduces (aten's
``vectorized_layer_norm_kernel<T, float, rms_norm=true>`` for rows of at most 128 elements: four-element lane FMA
chains, the shuffle-down tree, ``/ D``, ``+ eps``, ``rsqrtf``, ``round(w * (rstd * x))``), which belongs to the aten
build, so the op verifies itself: the first fast call of each (dtype, D, R) is compared with the eager chain by
``torch.equal``, and on a mismatch the op is disabled for the process with one warning. Its fallback (a refused input,
the op disabled) runs the norm module as written and the rotary as the fused, exact `rotary_half_partial`, so only the
norm fusion is lost.

The rewriter hands it a pending QK norm (``Q = A.norm_q(Q)``, the QK-norm form of `_rewriter_attention`) and the
model's own rotary function, ``fn`` (MiniMax-H3's ``_apply_rotary_emb``, checked by source digest where the form is
taken: `_chain_rotate_half.PARTIAL_DIGESTS`): R is the tables' width, read per call, never a per-family constant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site
from .qk_norm_rope import MAX_HEAD_DIM, _Norm, plain_norm_reason
from .rotary_half import _ARGS, layout_reason, partial_tables_reason, rotary_half_partial, rotary_half_partial_ref


def qk_norm_rotary_half_ref(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_site=None,
                            fn=None) -> torch.Tensor:
    """The eager chain: the norm module itself, then ``fn(y, cos, sin)`` (the model's rotary; the same expression,
    `rotary_half_partial_ref`, when None)."""
    return rotary_half_partial_ref(norm(x), cos, sin, fn)


def _fallback(norm, x, cos, sin, rope_site=None, fn=None) -> torch.Tensor:
    # the norm as written, the rotary still fused (exact by construction; it runs `fn` itself where it cannot)
    return rotary_half_partial(norm(x), cos, sin, rope_site, fn)


def _guard(norm, x, cos, sin, rope_site=None, fn=None, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    if not (isinstance(x, torch.Tensor) and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return "operand not a tensor"
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if x.dim() != 4:
        return "shape"
    dim = x.shape[-1]
    if dim % 4 or dim > MAX_HEAD_DIM:
        return "D outside the reproduced reduction"
    reason = plain_norm_reason(norm, dim, x.dtype)
    if reason is not None:
        return reason
    weight = norm.weight
    # the rotary's questions (tables' dtype and shape, R even and at most D), then the layout, autograd and devices of
    # x, the tables and the weight
    reason = partial_tables_reason(x, cos, sin) or layout_reason(x, cos, sin, weight)
    if reason is None and check_pointers and (x.data_ptr() % 8 or weight.data_ptr() % 8):
        return "not 8-byte aligned"  # aten's vectorised kernel (the order reproduced) needs aligned rows and weight
    return reason


# The NVRTC way: csrc/rotary.cu's head_norm_rotate_half_kernel, launched as launch_half launches it for a weight: one
# block of kHalfNormThreads 128 per row. Duplicated from there: that shape, the RotateHalfArgs fields (fastpath.h) and
# the output allocation; the guard stands for bindings_rotary.cpp's input checks.
_NVRTC = _nvrtc.Kernel(
    "rotary.cu",
    "diffusers_fastpath::head_norm_rotate_half_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
    _nvrtc.Params("head_norm_rotate_half_kernel", ("a", _ARGS)),
)
_HALF_NORM_THREADS = 128


def _nvrtc_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    rows, heads, dim = x.shape
    out = x.new_empty(x.shape)
    _NVRTC.launch(x.device.index, x.dtype, (rows, 1, 1), (_HALF_NORM_THREADS, 1, 1), out.data_ptr(), x.data_ptr(),
                  cos.data_ptr(), sin.data_ptr(), rows, heads, dim, cos.shape[1], cos.shape[0],
                  cos.dtype is torch.float32, _nvrtc.DTYPE_CODE[x.dtype], weight.data_ptr(), eps)
    return out


def _raw_guard(x, weight, eps, cos, sin):
    # bindings_rotary.cpp's checks: x [rows, heads, dim] (dim % 4 == 0, at most 128), weight [dim] of x's dtype, tables
    # [table_rows, rot_dim] of x's dtype or float32, everything contiguous, aligned, on x's CUDA device
    if x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or x.dtype not in HALF_DTYPES:
        return "shape or dtype"
    if x.shape[2] % 4 or x.shape[2] > MAX_HEAD_DIM:
        return "D outside the reproduced reduction"
    if (weight.dim() != 1 or weight.shape[0] != x.shape[2] or weight.dtype is not x.dtype
            or weight.device != x.device or not weight.is_contiguous() or weight.data_ptr() % 8 or x.data_ptr() % 8):
        return "weight, or alignment"
    if (cos.dtype not in (x.dtype, torch.float32) or sin.dtype is not cos.dtype or not cos.shape[0]
            or x.shape[0] % cos.shape[0] or cos.shape[1] % 2 or cos.shape[1] > x.shape[2]):
        return "tables"
    if not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()) or not x.is_cuda:
        return "strided or not CUDA"
    if cos.device != x.device or sin.device != x.device:
        return "devices differ"
    return None


_nvrtc.raw_op("_qk_norm_rotary_half_cuda", "(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin) -> Tensor",
              _raw_guard, _nvrtc_kernel)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_qk_norm_rotary_half_cuda")


def _kernel(norm, x, cos, sin, rope_site=None, fn=None) -> torch.Tensor:
    batch, seq, heads, dim = x.shape
    return _cuda_op(x.view(batch * seq, heads, dim), norm.weight, norm.eps, cos, sin).view(x.shape)


@torch.library.custom_op("diffusers_fastpath::qk_norm_rotary_half", mutates_args=())
def _qk_norm_rotary_half_op(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                            sin: torch.Tensor) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _guard(norm, x, cos, sin) is None:
        return _kernel(norm, x, cos, sin)
    return qk_norm_rotary_half_ref(norm, x, cos, sin).contiguous()


@_qk_norm_rotary_half_op.register_fake
def _qk_norm_rotary_half_fake(x, weight, eps, cos, sin):
    torch._check(x.dim() == 4, lambda: f"qk_norm_rotary_half: x must be [B, S, H, D], got {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _custom_op(norm, x, cos, sin, rope_site=None, fn=None) -> torch.Tensor:
    return torch.ops.diffusers_fastpath.qk_norm_rotary_half.default(x, norm.weight, norm.eps, cos, sin)


def _signature(norm, x, cos, *rest):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1], cos.shape[-1], "rotate-half")


QK_NORM_ROTARY_HALF = FusedOp(
    "qk_norm_rotary_half",
    ref=qk_norm_rotary_half_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=_custom_op,
    verify_key=_signature,
    fallback=_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def qk_norm_rotary_half(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: Site | None = None,
                        rope_site: Site | None = None, fn=None) -> torch.Tensor:
    """``fn(norm(x), cos, sin)``, MiniMax-H3's QK norm then its partial rotate-half rotary, fused.

    Bit-identical to eager everywhere: where the norm cannot be fused (see the module doc), it runs as written and the
    rotary still runs as the fused, exact `rotary_half_partial`.

    Args:
        norm: the QK norm, ``torch.nn.RMSNorm(D)`` of each head with a weight of x's dtype (``attn.norm_q``/``norm_k``).
        x: ``[B, S, H, D]`` queries or keys before the norm (fp16/bf16, D a multiple of 4 up to 128, take the kernel).
        cos, sin: ``[S, R]`` tables (float32, cast to x's dtype as the function does, or of x's dtype), R even and at
            most D: the channels rotated, the rest passed through.
        site: counters of this fused op at the call site; ``rope_site``: of the `rotary_half_partial` it falls back
            to; fn: the model's rotary function, which the eager chain calls (the same expression when None).

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import qk_norm_rotary_half, qk_norm_rotary_half_ref
        >>> norm, x = torch.nn.RMSNorm(8, eps=1e-5), torch.randn(2, 5, 3, 8)
        >>> cos, sin = torch.randn(5, 6), torch.randn(5, 6)
        >>> with torch.no_grad():
        ...     torch.equal(qk_norm_rotary_half(norm, x, cos, sin), qk_norm_rotary_half_ref(norm, x, cos, sin))
        True
    """
    return QK_NORM_ROTARY_HALF(site, norm, x, cos, sin, rope_site, fn)
