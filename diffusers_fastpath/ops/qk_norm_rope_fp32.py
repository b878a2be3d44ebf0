"""FLUX.3's QK norm and rotary embedding in float32, cast back, in one pass.

Eager (``Flux3AttnProcessor``, T = bf16 or fp16; ``norm_q``/``norm_k`` are ``torch.nn.RMSNorm(head_dim)`` kept in
float32 by the model's ``_keep_in_fp32_modules``)::

    query = attn.norm_q(query.float())                                 # float32 norm of the upcast q
    query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)  # diffusers' rotary, all in float32
    query = query.to(value.dtype)                                      # the one rounding, back to T

The kernel (``csrc/rotary.cu``, ``kHeadNormF32``) reads ``x`` in T once and writes ``out`` in T once. The upcast is
exact, and aten runs the same vectorised RMSNorm kernel for float as for bf16/fp16 (``vec_size`` 4 for every dtype:
the same lanes, FMA chain of squares, shuffle tree, ``/ D``, ``+ eps``, ``rsqrtf``), so the sum of squares is the one
`qk_norm_rope` reproduces; what differs is that ``w * (rstd * x)`` stays a float (the weight read as float), the
rotary's products and sum are float operations on that unrounded value, and only the cast back rounds. The reduction
order belongs to the aten build, so the op verifies itself on its first fast call per (dtype, head_dim), like
`qk_norm_rope`; on a mismatch it is disabled for the process with one warning and its calls run the eager chain.

The rewriter runs this op only where it proved that the processor casts the rotary's result to x's dtype right after
it (nothing reads it in float32 in between); elsewhere the chain runs as written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FusedOp, Site
from .qk_norm_rope import _Norm, _guard as _head_guard
from .rotary import nvrtc_rotary


def qk_norm_rope_fp32_ref(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_site=None) -> torch.Tensor:
    """The eager chain: the norm module on ``x.float()``, diffusers' ``apply_rotary_emb`` in float32, ``.to(x.dtype)``."""
    return apply_rotary_emb(norm(x.float()), (cos, sin), sequence_dim=1).to(x.dtype)


def _guard(norm, x, cos, sin, rope_site=None, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    return _head_guard(None, None, norm, x, cos, sin, None, check_pointers, fp32_norm=True)


def _nvrtc_kernel(x, weight, eps, cos, sin, round_norm) -> torch.Tensor:
    # bindings.cpp's qk_norm_rope_fp32 on the NVRTC way: csrc/rotary.cu's kernel with the float32 norm (kHeadNormF32),
    # or with `round_norm` Krea 2's (kHeadNormF32W)
    return nvrtc_rotary(None, None, 0.0, x, weight, eps, cos, sin, True, norm_fp32=not round_norm,
                        norm_f32w=round_norm)


def _raw_guard(x, weight, eps, cos, sin, round_norm):
    return _guard(_Norm(weight, eps), x, cos, sin)


_nvrtc.raw_op("_qk_norm_rope_fp32_cuda",
              "(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin, bool round_norm) -> Tensor",
              _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_qk_norm_rope_fp32_cuda")  # (x, weight, eps, cos, sin, round_norm)


def _kernel(norm, x, cos, sin, rope_site=None) -> torch.Tensor:
    return _launch(x, norm.weight, norm.eps, cos, sin, False)


@torch.library.custom_op("diffusers_fastpath::qk_norm_rope_fp32", mutates_args=())
def _qk_norm_rope_fp32_op(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                          sin: torch.Tensor) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _guard(norm, x, cos, sin) is None:
        return _kernel(norm, x, cos, sin)
    return qk_norm_rope_fp32_ref(norm, x, cos, sin).contiguous()


@_qk_norm_rope_fp32_op.register_fake
def _qk_norm_rope_fp32_fake(x, weight, eps, cos, sin):
    torch._check(x.dim() == 4, lambda: f"qk_norm_rope_fp32: x must be [B, S, H, D], got {tuple(x.shape)}")
    return x.new_empty(x.shape)


def _custom_op(norm, x, cos, sin, rope_site=None) -> torch.Tensor:
    return torch.ops.diffusers_fastpath.qk_norm_rope_fp32.default(x, norm.weight, norm.eps, cos, sin)


def _signature(norm, x, *rest):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1], "fp32 norm")


QK_NORM_ROPE_FP32 = FusedOp(
    "qk_norm_rope_fp32",
    ref=qk_norm_rope_fp32_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=_custom_op,
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def qk_norm_rope_fp32(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, site: Site | None = None,
                      rope_site: Site | None = None) -> torch.Tensor:
    """``apply_rotary_emb(norm(x.float()), (cos, sin), sequence_dim=1).to(x.dtype)``, fused; bit-identical to eager
    everywhere (where the kernel cannot run, or failed its verification, the eager chain runs).

    Args:
        norm: the QK norm, ``torch.nn.RMSNorm(head_dim)`` with a float32 weight (``attn.norm_q``/``norm_k``).
        x: ``[B, S, H, D]`` bf16/fp16 queries or keys, before the upcast.
        cos, sin: fp32 ``[S, D]`` rotary tables.
        site: counters of this fused op at the call site; ``rope_site`` is accepted for the call sites' symmetry with
            `qk_norm_rope` (the eager chain's float32 rotary has no fused form).

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import qk_norm_rope_fp32, qk_norm_rope_fp32_ref
        >>> norm, x = torch.nn.RMSNorm(8, eps=1e-6), torch.randn(1, 5, 2, 8, dtype=torch.bfloat16)
        >>> cos, sin = torch.randn(5, 8), torch.randn(5, 8)
        >>> with torch.no_grad():
        ...     torch.equal(qk_norm_rope_fp32(norm, x, cos, sin), qk_norm_rope_fp32_ref(norm, x, cos, sin))
        True
    """
    return QK_NORM_ROPE_FP32(site, norm, x, cos, sin, rope_site)


# ------------------------------------------------------------------------------------------ Krea 2's QK norm
# Krea2RMSNorm (the rewriter hands this op only a module whose forward's source is that class's, by digest)::
#
#     y = F.rms_norm(x.float(), (dim,), weight=self.weight + 1.0, eps=self.eps).to(x.dtype)   # float32 weight
#     out = apply_rotary_emb(y, (cos, sin), sequence_dim=1)                                   # in x's dtype
#
# The same aten kernel and order as above on the upcast x, the result rounded to x's dtype as `qk_norm_rope` rounds
# its norm (csrc/rotary.cu's kHeadNormF32W), then the exact rotary; the weight ``self.weight + 1.0`` is computed as the
# forward computes it (one float32 add) before the launch. Self-verified per (dtype, head_dim) like the others.


def qk_norm_rope_zero_centred_ref(norm, x, cos, sin, rope_site=None) -> torch.Tensor:
    """The eager chain: the norm module itself, then diffusers' ``apply_rotary_emb``."""
    return apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1)


def _zc_guard(norm, x, cos, sin, rope_site=None, check_pointers: bool = True) -> str | None:
    weight, eps, dim = (getattr(norm, n, None) for n in ("weight", "eps", "dim"))
    if not (isinstance(weight, torch.Tensor) and isinstance(eps, float) and isinstance(dim, int)
            and weight.shape == (dim,) and x.shape[-1:] == (dim,)):
        return "norm not a zero-centred RMSNorm of head_dim"
    return _guard(_Norm(weight, eps), x, cos, sin, None, check_pointers)


def _zc_kernel(norm, x, cos, sin, rope_site=None) -> torch.Tensor:
    return _launch(x, norm.weight + 1.0, norm.eps, cos, sin, True)  # the forward's own float32 add


def _zc_custom_op(norm, x, cos, sin, rope_site=None) -> torch.Tensor:
    return torch.ops.diffusers_fastpath.qk_norm_rope_zero_centred.default(x, norm.weight, norm.eps, cos, sin)


class _ZeroCentred:
    """Krea2RMSNorm's computation from its weight and eps, for the custom op (which takes tensors and floats)."""

    __slots__ = ("weight", "eps", "dim")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps, self.dim = weight, eps, weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (self.dim,), weight=self.weight + 1.0, eps=self.eps).to(x.dtype)


@torch.library.custom_op("diffusers_fastpath::qk_norm_rope_zero_centred", mutates_args=())
def _qk_norm_rope_zc_op(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    norm = _ZeroCentred(weight, eps)
    if _zc_guard(norm, x, cos, sin) is None:
        return _zc_kernel(norm, x, cos, sin)
    return qk_norm_rope_zero_centred_ref(norm, x, cos, sin).contiguous()


@_qk_norm_rope_zc_op.register_fake
def _qk_norm_rope_zc_fake(x, weight, eps, cos, sin):
    return x.new_empty(x.shape)


def _zc_signature(norm, x, *rest):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1], "zero-centred norm")


QK_NORM_ROPE_ZERO_CENTRED = FusedOp(
    "qk_norm_rope_zero_centred",
    ref=qk_norm_rope_zero_centred_ref,
    guard=_zc_guard,
    kernel=_zc_kernel,
    custom_op=_zc_custom_op,
    verify_key=_zc_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def qk_norm_rope_zero_centred(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              site: Site | None = None, rope_site: Site | None = None) -> torch.Tensor:
    """Krea 2's ``apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1)`` with ``norm`` a ``Krea2RMSNorm``, fused;
    bit-identical to eager everywhere (where the kernel cannot run, or failed its verification, the eager chain).

    Args:
        norm: the QK norm (``attn.norm_q``/``norm_k``): ``weight`` float32 ``[head_dim]`` (the scale is
            ``1 + weight``), ``eps``, ``dim``; the caller has checked that its forward is Krea2RMSNorm's.
        x: ``[B, S, H, D]`` bf16/fp16 queries or keys.
        cos, sin: fp32 ``[S, D]`` rotary tables.
        site: counters of this fused op at the call site; ``rope_site`` is accepted for symmetry.
    """
    return QK_NORM_ROPE_ZERO_CENTRED(site, norm, x, cos, sin, rope_site)
