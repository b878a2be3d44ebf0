"""The matrix-form rotary embedding of Kandinsky 5's and 6's processors, in one pass over ``x``.

Eager (``transformer_kandinsky6.apply_rotary``; T = bf16 or fp16, ``rope`` float32 ``[..., 1, D/2, 2, 2]`` over
``x``'s ``[..., H, D]``, each ``[2, 2]`` the matrix ``[[cos, -sin], [sin, cos]]`` of a pair)::

    x_ = x.reshape(*x.shape[:-1], -1, 1, 2).float()
    (rope.float() * x_).sum(dim=-1).reshape(*x.shape).to(x.dtype)

an fp32 multiply (each product rounded once), aten's sum over the two products of each matrix row, a rounding to T.
aten's reduce kernel starts each accumulator from the identity and combines them, so the sum of a row is
``(0 + p0) + (0 + p1)``: the value of ``p0 + p1`` but for two negative zeros, whose sum it makes ``+0``.
The kernel (``csrc/rotary.cu``, ``rotary_matrix_kernel``) performs those very IEEE operations in that order
(``__fmul_rn``/``__fadd_rn``): exact by construction (the sum of two numbers does not depend on which of them the
reduction takes first), no self-verification. Anything else (tables of another dtype or per head, a broadcast over
x's leading dimensions, strided operands) runs the function as written. The rewriter takes a call only of a function
whose source is one these models define (checked by digest: ``models/_chain_rotary_matrix``).
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site
from .rotary_half import layout_reason


def rotary_matrix_ref(x: torch.Tensor, rope: torch.Tensor, fn=None) -> torch.Tensor:
    """The eager call ``fn(x, rope)`` (`fn` the model's function; None: the same expression, for the custom op)."""
    if fn is not None:
        return fn(x, rope)
    x_ = x.reshape(*x.shape[:-1], -1, 1, 2).float()
    return (rope.float() * x_).sum(dim=-1).reshape(*x.shape).to(dtype=x.dtype)


def _guard(x, rope, fn=None, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if rope.dtype is not torch.float32:
        return "rope dtype"
    if x.dim() < 2 or x.shape[-1] % 2:
        return "shape"
    lead = rope.dim() - 4  # the table's leading dims: x's innermost leading ones (the tokens), shared by the heads
    if lead < 0 or lead > x.dim() - 2 or rope.shape[-4:] != (1, x.shape[-1] // 2, 2, 2):
        return "shape"
    if rope.shape[:-4] != x.shape[x.dim() - 2 - lead:-2]:
        return "shape"  # a table broadcast over its own leading dims, or per head
    reason = layout_reason(x, rope)
    if reason is not None:
        return reason
    if check_pointers and rope.data_ptr() % 16:
        return "rope alignment"  # (a slice of a table; the kernel reads each pair's matrix as one float4)
    return None


# The NVRTC way: csrc/rotary.cu's rotary_matrix_kernel, launched as launch_matrix and bindings.cpp's rotary_matrix do:
# one block of kMatrixThreads 256 per row. Duplicated from there: that shape, the RotaryMatrixArgs fields (fastpath.h)
# and the output allocation; the guard stands for bindings.cpp's input checks.
_ARGS = _nvrtc.Params("RotaryMatrixArgs", ("out", "P"), ("x", "P"), ("rope", "P"), ("rows", "q"), ("heads", "q"),
                      ("dim", "q"), ("table_rows", "q"), ("dtype", "i"))
_NVRTC = _nvrtc.Kernel(
    "rotary.cu",
    "diffusers_fastpath::rotary_matrix_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
    _nvrtc.Params("rotary_matrix_kernel", ("a", _ARGS)),
)
_MATRIX_THREADS = 256


def _nvrtc_kernel(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    rows, heads, dim = x.shape
    out = x.new_empty(x.shape)
    _NVRTC.launch(x.device.index, x.dtype, (rows, 1, 1), (_MATRIX_THREADS, 1, 1), out.data_ptr(), x.data_ptr(),
                  rope.data_ptr(), rows, heads, dim, rope.shape[0], _nvrtc.DTYPE_CODE[x.dtype])
    return out


def _raw_guard(x, rope):
    # bindings.cpp's checks: x [rows, heads, dim] of a half dtype, rope float32 [table_rows, 2 * dim], 16-byte aligned
    if x.dim() != 3 or rope.dim() != 2 or x.dtype not in HALF_DTYPES or x.shape[2] % 2:
        return "shape or dtype"
    if (rope.dtype is not torch.float32 or not rope.shape[0] or x.shape[0] % rope.shape[0]
            or rope.shape[1] != 2 * x.shape[2] or rope.data_ptr() % 16):
        return "tables"
    if not (x.is_contiguous() and rope.is_contiguous()) or not x.is_cuda or rope.device != x.device:
        return "strided or not CUDA"
    return None


_nvrtc.raw_op("_rotary_matrix_cuda", "(Tensor x, Tensor rope) -> Tensor", _raw_guard, _nvrtc_kernel)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_rotary_matrix_cuda")


def _kernel(x, rope, fn=None) -> torch.Tensor:
    heads, dim = x.shape[-2:]
    return _cuda_op(x.view(-1, heads, dim), rope.view(-1, 2 * dim)).view(x.shape)


def _impl(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    if _guard(x, rope) is None:
        return _kernel(x, rope)
    return rotary_matrix_ref(x, rope).contiguous()


_op = torch.library.custom_op("diffusers_fastpath::rotary_matrix", _impl, mutates_args=())
_op.register_fake(lambda x, rope: torch.empty_like(x, memory_format=torch.contiguous_format))
_raw = torch.ops.diffusers_fastpath.rotary_matrix.default

ROTARY_MATRIX = FusedOp("rotary_matrix", ref=rotary_matrix_ref, guard=_guard, kernel=_kernel,
                        custom_op=lambda x, rope, fn=None: _raw(x, rope))


def rotary_matrix(x: torch.Tensor, rope: torch.Tensor, site: Site | None = None, fn=None) -> torch.Tensor:
    """Kandinsky 6's ``apply_rotary(x, rope)`` (``fn``), fused on CUDA and bit-identical to eager.

    Args:
        x: ``[..., H, D]`` queries or keys (fp16/bf16 take the kernel).
        rope: float32 ``[..., 1, D/2, 2, 2]`` rotation matrices, its leading dims x's innermost leading ones
            (Kandinsky 6: x ``[B, S, H, D]``, rope ``[S, 1, D/2, 2, 2]``).
        site: the call site's counters; fn: the model's function, which the eager path calls (the same expression
            when None).

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import rotary_matrix, rotary_matrix_ref
        >>> x, rope = torch.randn(2, 5, 3, 8).bfloat16(), torch.randn(5, 1, 4, 2, 2)
        >>> torch.equal(rotary_matrix(x, rope), rotary_matrix_ref(x, rope))
        True
    """
    return ROTARY_MATRIX(site, x, rope, fn)
