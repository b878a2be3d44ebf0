"""The rotate-half rotary embedding written inline in the storage dtype, in one pass over ``x``.

Eager (Ideogram 4's and Cosmos 3's processors; T = bf16 or fp16, ``cos``/``sin`` of T, ``[..., 1, D]`` over
``x``'s ``[..., H, D]``)::

    x * cos + rotate_half(x) * sin          # rotate_half(x) = torch.cat((-x[..., D/2:], x[..., :D/2]), dim=-1)

three aten ops on T tensors, each computing in fp32 and rounding to T (the negation is exact)::

    out[i]       = round(round(x[i] * cos[i]) + round(-x[i + D/2] * sin[i]))           i < D/2
    out[i + D/2] = round(round(x[i + D/2] * cos[i + D/2]) + round(x[i] * sin[i + D/2]))

The kernel (``csrc/rotary.cu``, ``rotate_half_kernel``) keeps every one of those rounding points with separate IEEE
operations: exact by construction, no self-verification. Anything else (tables of another dtype, which promote the
products to fp32; a broadcast over leading dimensions; strided operands) runs the expression as written. The
rewriter takes the expression only with a ``rotate_half`` function whose source is the one these models define
(checked by digest at run time: `is_rotate_half`).
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site, autograd_device_reason


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # what the models' own ``_rotate_half`` computes (the reference of the CPU tests)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn=None) -> torch.Tensor:
    """The eager expression, ``x * cos + fn(x) * sin`` (`fn` the model's rotate-half function; a stand-in if None)."""
    return x * cos + (fn or _rotate_half)(x) * sin


def layout_reason(x, *tables) -> str | None:
    """What the rotary guards ask once the dtypes and shapes fit (these and `rotary_matrix`'s): a non-empty x, every
    operand contiguous, no autograd, one CUDA device."""
    if x.numel() == 0:
        return "empty"
    if not (x.is_contiguous() and all(t.is_contiguous() for t in tables)):
        return "strided"
    return autograd_device_reason(x, *tables)


def _guard(x, cos, sin, fn=None, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    if not (isinstance(x, torch.Tensor) and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return "operand not a tensor"  # a Python scalar table: eager broadcasts it
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if cos.dtype is not x.dtype or sin.dtype is not x.dtype:
        return "cos/sin dtype differs"  # the products would promote to fp32: another arithmetic
    if x.dim() < 2 or x.shape[-1] % 2:
        return "shape"
    if cos.shape != sin.shape or cos.shape != (*x.shape[:-2], 1, x.shape[-1]):
        return "shape"  # [..., 1, D] over [..., H, D]: no broadcast over the leading dimensions
    return layout_reason(x, cos, sin)


# The NVRTC way: csrc/rotary.cu's rotate_half_kernel, launched as launch_half and bindings.cpp's rotary_half do: one
# block of kHalfThreads 256 per row. Duplicated from there: that shape, the RotateHalfArgs fields (fastpath.h) and
# the output allocation; the guard stands for bindings.cpp's input checks.
_ARGS = _nvrtc.Params("RotateHalfArgs", ("out", "P"), ("x", "P"), ("cos", "P"), ("sin", "P"), ("rows", "q"),
                      ("heads", "q"), ("dim", "q"), ("rot_dim", "q"), ("table_rows", "q"), ("tables_f32", "?"),
                      ("dtype", "i"), ("weight", "P"), ("eps", "f"))  # (weight: qk_norm_rotary_half's norm, here null)
_NVRTC = _nvrtc.Kernel(
    "rotary.cu",
    "diffusers_fastpath::rotate_half_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
    _nvrtc.Params("rotate_half_kernel", ("a", _ARGS)),
)
_HALF_THREADS = 256


def _nvrtc_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rows, heads, dim = x.shape
    out = x.new_empty(x.shape)
    _NVRTC.launch(x.device.index, x.dtype, (rows, 1, 1), (_HALF_THREADS, 1, 1), out.data_ptr(), x.data_ptr(),
                  cos.data_ptr(), sin.data_ptr(), rows, heads, dim, cos.shape[1], cos.shape[0],
                  cos.dtype is torch.float32, _nvrtc.DTYPE_CODE[x.dtype], 0, 0.0)
    return out


def _raw_guard(x, cos, sin):
    # bindings.cpp's checks: x [rows, heads, dim], tables [table_rows, rot_dim] of x's dtype or float32
    if x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or x.dtype not in HALF_DTYPES:
        return "shape or dtype"
    if (cos.dtype not in (x.dtype, torch.float32) or sin.dtype is not cos.dtype or not cos.shape[0]
            or x.shape[0] % cos.shape[0] or cos.shape[1] % 2 or cos.shape[1] > x.shape[2]):
        return "tables"
    if not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()) or not x.is_cuda:
        return "strided or not CUDA"
    return None


_nvrtc.raw_op("_rotary_half_cuda", "(Tensor x, Tensor cos, Tensor sin) -> Tensor", _raw_guard, _nvrtc_kernel)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_rotary_half_cuda")


def _kernel(x, cos, sin, fn=None) -> torch.Tensor:
    heads, dim = x.shape[-2:]
    out = _cuda_op(x.view(-1, heads, dim), cos.view(-1, dim), sin.view(-1, dim))
    return out.view(x.shape)


def _fused(name: str, ref, guard, kernel) -> FusedOp:
    """The custom op ``diffusers_fastpath::<name>(x, cos, sin)`` (`kernel` where `guard` allows, `ref` elsewhere; what
    ``torch.compile`` sees) and the fused op over it."""
    def impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if guard(x, cos, sin) is None:
            return kernel(x, cos, sin)
        return ref(x, cos, sin).contiguous()

    op = torch.library.custom_op(f"diffusers_fastpath::{name}", impl, mutates_args=())
    op.register_fake(lambda x, cos, sin: torch.empty_like(x, memory_format=torch.contiguous_format))
    raw = getattr(torch.ops.diffusers_fastpath, name).default
    return FusedOp(name, ref=ref, guard=guard, kernel=kernel, custom_op=lambda x, cos, sin, fn=None: raw(x, cos, sin))


ROTARY_HALF = _fused("rotary_half", rotary_half_ref, _guard, _kernel)


def rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: Site | None = None,
                fn=None) -> torch.Tensor:
    """``x * cos + fn(x) * sin`` with ``fn`` the rotate-half function, fused on CUDA and bit-identical to eager.

    Args:
        x: ``[..., H, D]`` queries or keys (fp16/bf16 take the kernel).
        cos, sin: ``[..., 1, D]`` tables of x's dtype (Ideogram 4's ``[B, S, 1, D]``, Cosmos 3's ``[N, 1, D]``).
        site: the call site's counters; fn: the model's rotate-half function, which the eager expression calls
            (a stand-in computing the same when None).

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import rotary_half, rotary_half_ref
        >>> x, cos, sin = torch.randn(2, 5, 3, 8).bfloat16(), *torch.randn(2, 2, 5, 1, 8).bfloat16()
        >>> torch.equal(rotary_half(x, cos, sin), rotary_half_ref(x, cos, sin))
        True
    """
    return ROTARY_HALF(site, x, cos, sin, fn)


# ------------------------------------------------------------------------------------------ the partial form
# MiniMax-H3's ``_apply_rotary_emb(x, cos, sin)`` (checked by digest where the rewriter takes it): the same rotation
# over the first R = cos.shape[-1] channels of each head of ``x`` [B, S, H, D], with float32 tables [S, R] cast to
# x's dtype first, the other channels passed through, the result contiguous.


def rotary_half_partial_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn=None) -> torch.Tensor:
    """The eager call ``fn(x, cos, sin)`` (`fn` MiniMax-H3's function; None: the same expression, for the custom op)."""
    if fn is not None:
        return fn(x, cos, sin)
    r = cos.shape[-1]
    c, s = cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]
    rot = x[..., :r]
    return torch.cat((rot * c + _rotate_half(rot) * s, x[..., r:]), dim=-1).contiguous()


def _partial_guard(x, cos, sin, fn=None, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    return partial_tables_reason(x, cos, sin) or layout_reason(x, cos, sin)


def partial_tables_reason(x, cos, sin) -> str | None:
    """The partial form's questions of x's dtype and shape and of the tables (this guard's and
    `qk_norm_rotary_half`'s, which then asks `layout_reason` with its norm's weight too), or ``None``."""
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if cos.dtype not in (x.dtype, torch.float32) or sin.dtype is not cos.dtype:
        return "cos/sin dtype"
    if x.dim() != 4 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[1]:
        return "shape"
    if cos.shape[1] % 2 or not 0 < cos.shape[1] <= x.shape[3]:
        return "rotary dim odd or above head_dim"
    return None


def _partial_kernel(x, cos, sin, fn=None) -> torch.Tensor:
    batch, seq, heads, dim = x.shape
    return _cuda_op(x.view(batch * seq, heads, dim), cos, sin).view(x.shape)


ROTARY_HALF_PARTIAL = _fused("rotary_half_partial", rotary_half_partial_ref, _partial_guard, _partial_kernel)


def rotary_half_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: Site | None = None,
                        fn=None) -> torch.Tensor:
    """MiniMax-H3's ``_apply_rotary_emb(x, cos, sin)``, fused on CUDA and bit-identical to eager.

    Args:
        x: ``[B, S, H, D]`` queries or keys (fp16/bf16 take the kernel).
        cos, sin: ``[S, R]`` tables (float32, cast to x's dtype as the function does, or of x's dtype), R even and at
            most D: the channels rotated, the rest passed through.
        site: the call site's counters; fn: the model's function, which the eager path calls (the same expression
            when None).

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import rotary_half_partial, rotary_half_partial_ref
        >>> x, cos, sin = torch.randn(2, 5, 3, 8).bfloat16(), *torch.randn(2, 5, 6)
        >>> torch.equal(rotary_half_partial(x, cos, sin), rotary_half_partial_ref(x, cos, sin))
        True
    """
    return ROTARY_HALF_PARTIAL(site, x, cos, sin, fn)
