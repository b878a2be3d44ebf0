"""FLUX's QK RMSNorm, the text/image concatenation and the rotary embedding of q or k in one pass.

Eager (``FluxAttnProcessor``, T = bf16 or fp16, ``norm_*`` are ``torch.nn.RMSNorm(head_dim)`` with weights)::

    y = norm_img(x_img)                                   # single blocks: only this source
    y = torch.cat([norm_txt(x_txt), y], dim=1)            # dual blocks: text first
    out = apply_rotary_emb(y, (cos, sin), sequence_dim=1)

The kernel (``csrc/rotary.cu``) reads each source once and writes ``out`` once. The rotary part is exact by
construction (see `rotary_emb`); the norm reproduces what torch runs for ``torch.nn.RMSNorm`` on CUDA when the weight
has the input's dtype: ``aten::rms_norm`` -> ``_fused_rms_norm`` -> ``_fused_rms_norm_cuda``
(``aten/src/ATen/native/layer_norm.cpp``, ``rms_norm_symint``; ``aten/src/ATen/native/cuda/layer_norm_kernel.cu``,
``vectorized_layer_norm_kernel<T, float, rms_norm=true>`` with block (32, 16) and four elements per lane). Its sum of
squares is a per-lane FMA chain over four elements, then a shuffle-down tree (16, 8, 4, 2, 1), then ``/ D``,
``+ eps``, ``rsqrtf``, and ``round(w * (rstd * x))`` (every step is in ``csrc/rotary.cu``; read off the sm_90 SASS
of torch 2.11.0+cu130's kernel, bf16 and fp16). That order belongs to the aten build, so the op verifies itself: the first fast call of each (dtype, head_dim) is compared with the eager
chain by ``torch.equal``; on a mismatch the op is disabled for the process with one warning, and its calls run the
norms and the concatenation eagerly followed by the exact fused `rotary_emb`, so only the norm fusion is lost.

The guard admits what takes aten's vectorised kernel: exactly ``torch.nn.RMSNorm`` (no hooks, weight of the input's
dtype, explicit eps), head_dim a multiple of 4 up to 128, sources with unit innermost stride and 8-byte aligned rows
(aten copies a strided input to a contiguous one first, which does not change the result), no autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _nvrtc
from ._build import launcher
from ._policy import HALF_DTYPES, FusedOp, Site
from .rotary import cos_sin_reason, nvrtc_rotary, rotary_emb, rotary_emb_ref, rows_ok

MAX_HEAD_DIM = 128  # the reproduced reduction: one warp per row, at most four elements per lane


class _Norm:
    """A ``torch.nn.RMSNorm`` as weight and eps, for the custom op (which takes tensors and floats)."""

    __slots__ = ("weight", "eps")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # what torch.nn.RMSNorm.forward runs


def _normed_cat(norm_txt, x_txt, norm_img, x_img) -> torch.Tensor:
    y = norm_img(x_img)
    if x_txt is not None:
        y = torch.cat([norm_txt(x_txt), y], dim=1)
    return y


def qk_norm_rope_ref(norm_txt, x_txt, norm_img, x_img, cos, sin, rope_site=None) -> torch.Tensor:
    """The eager chain: the norm modules themselves, ``torch.cat``, diffusers' ``apply_rotary_emb``."""
    return rotary_emb_ref(_normed_cat(norm_txt, x_txt, norm_img, x_img), cos, sin)


def _fallback(norm_txt, x_txt, norm_img, x_img, cos, sin, rope_site=None) -> torch.Tensor:
    # Where the norm cannot be fused (or failed its verification), the rotary part still can: exact by construction.
    return rotary_emb(_normed_cat(norm_txt, x_txt, norm_img, x_img), cos, sin, rope_site)


def _plain_rms_norm(norm, dim: int) -> bool:
    """``norm(x)`` is exactly ``F.rms_norm(x, (dim,), norm.weight, norm.eps)`` with a weight."""
    if type(norm) is _Norm:
        return norm.weight is not None and norm.eps is not None
    return (
        type(norm) is torch.nn.RMSNorm
        and norm.weight is not None
        and norm.eps is not None
        and tuple(norm.normalized_shape) == (dim,)
        and not (norm._forward_hooks or norm._forward_pre_hooks or "forward" in norm.__dict__)
    )


def _guard(norm_txt, x_txt, norm_img, x_img, cos, sin, rope_site=None, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    dtype = x_img.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if x_img.dim() != 4 or (x_txt is not None and (x_txt.dim() != 4 or x_txt.dtype is not dtype)):
        return "shape"
    batch, seq, heads, dim = x_img.shape
    if x_txt is not None and (x_txt.shape[0], x_txt.shape[2], x_txt.shape[3]) != (batch, heads, dim):
        return "shape"
    if dim % 4 or dim > MAX_HEAD_DIM:
        return "D outside the reproduced reduction"
    sources = ((norm_img, x_img),) if x_txt is None else ((norm_txt, x_txt), (norm_img, x_img))
    if not all(_plain_rms_norm(norm, dim) for norm, _ in sources):
        return "norm not a plain torch.nn.RMSNorm with weight"
    if any(norm.weight.dtype is not dtype for norm, _ in sources):
        return "norm weight dtype differs"  # aten then takes its composite path, another reduction
    if x_img.numel() == 0:
        return "empty"
    if batch > 65535:
        return "batch above 65535"
    if not all(rows_ok(x) for _, x in sources):
        return "x strided"
    if torch.is_grad_enabled() and any(x.requires_grad or norm.weight.requires_grad for norm, x in sources):
        return "requires grad"
    if not x_img.is_cuda:
        return f"device {x_img.device.type}"
    device = x_img.device
    if any(x.device != device or norm.weight.device != device for norm, x in sources):
        return "devices differ"
    if not all(norm.weight.is_contiguous() for norm, _ in sources):
        return "norm weight strided"
    seq_total = seq + (0 if x_txt is None else x_txt.shape[1])
    reason = cos_sin_reason(cos, sin, seq_total, dim, device, check_pointers)
    if reason is None and check_pointers and any(x.data_ptr() % 8 or norm.weight.data_ptr() % 8 for norm, x in sources):
        return "not 8-byte aligned"  # aten's vectorised kernel needs 8-byte aligned rows and weight too
    return reason


def _nvrtc_kernel(x_txt, weight_txt, eps_txt, x_img, weight_img, eps_img, cos, sin, out=None) -> torch.Tensor:
    # bindings.cpp's qk_norm_rope(_out) on the NVRTC way: csrc/rotary.cu's kernel with norm (see ops/rotary.py).
    return nvrtc_rotary(x_txt, weight_txt, eps_txt, x_img, weight_img, eps_img, cos, sin, True, out)


def _raw_guard(x_txt, weight_txt, eps_txt, x_img, weight_img, eps_img, cos, sin):
    norm_txt, norm_img = _norms(weight_txt, eps_txt, weight_img, eps_img)
    return _guard(norm_txt, x_txt, norm_img, x_img, cos, sin)


_QK_SCHEMA = ("Tensor? x_txt, Tensor? weight_txt, float eps_txt, Tensor x_img, Tensor weight_img, float eps_img, "
              "Tensor cos, Tensor sin")
_nvrtc.raw_op("_qk_norm_rope_cuda", f"({_QK_SCHEMA}) -> Tensor", _raw_guard, _nvrtc_kernel)
_nvrtc.raw_op("_qk_norm_rope_cuda_out", f"(Tensor(a!) out, {_QK_SCHEMA}) -> ()", _raw_guard, _nvrtc_kernel, outs=1)

_cuda_op = None


def _kernel(norm_txt, x_txt, norm_img, x_img, cos, sin, rope_site=None) -> torch.Tensor:
    global _cuda_op
    if _cuda_op is None:
        _cuda_op = launcher(_nvrtc_kernel, "_qk_norm_rope_cuda")
    if x_txt is None:
        return _cuda_op(None, None, 0.0, x_img, norm_img.weight, norm_img.eps, cos, sin)
    return _cuda_op(x_txt, norm_txt.weight, norm_txt.eps, x_img, norm_img.weight, norm_img.eps, cos, sin)


def _norms(weight_txt, eps_txt, weight_img, eps_img):
    return (None if weight_txt is None else _Norm(weight_txt, eps_txt)), _Norm(weight_img, eps_img)


@torch.library.custom_op("diffusers_fastpath::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    x_txt: torch.Tensor | None,
    weight_txt: torch.Tensor | None,
    eps_txt: float,
    x_img: torch.Tensor,
    weight_img: torch.Tensor,
    eps_img: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    norm_txt, norm_img = _norms(weight_txt, eps_txt, weight_img, eps_img)
    if _guard(norm_txt, x_txt, norm_img, x_img, cos, sin) is None:
        return _kernel(norm_txt, x_txt, norm_img, x_img, cos, sin)
    return qk_norm_rope_ref(norm_txt, x_txt, norm_img, x_img, cos, sin).contiguous()


@_qk_norm_rope_op.register_fake
def _qk_norm_rope_fake(x_txt, weight_txt, eps_txt, x_img, weight_img, eps_img, cos, sin):
    torch._check(x_img.dim() == 4, lambda: f"qk_norm_rope: x must be [B, S, H, D], got {tuple(x_img.shape)}")
    torch._check((x_txt is None) == (weight_txt is None), lambda: "qk_norm_rope: x_txt and weight_txt go together")
    batch, seq, heads, dim = x_img.shape
    if x_txt is not None:
        seq = seq + x_txt.shape[1]
    return x_img.new_empty((batch, seq, heads, dim))


def _custom_op(norm_txt, x_txt, norm_img, x_img, cos, sin, rope_site=None) -> torch.Tensor:
    weight_txt, eps_txt = (None, 0.0) if x_txt is None else (norm_txt.weight, norm_txt.eps)
    return torch.ops.diffusers_fastpath.qk_norm_rope.default(
        x_txt, weight_txt, eps_txt, x_img, norm_img.weight, norm_img.eps, cos, sin
    )


def _signature(norm_txt, x_txt, norm_img, x_img, *rest):
    return (str(x_img.dtype).removeprefix("torch."), x_img.shape[-1])


QK_NORM_ROPE = FusedOp(
    "qk_norm_rope",
    ref=qk_norm_rope_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=_custom_op,
    verify_key=_signature,
    fallback=_fallback,
)


def qk_norm_rope(
    norm_txt,
    x_txt: torch.Tensor | None,
    norm_img,
    x_img: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    site: Site | None = None,
    rope_site: Site | None = None,
) -> torch.Tensor:
    """``apply_rotary_emb(cat([norm_txt(x_txt), norm_img(x_img)], 1), (cos, sin), sequence_dim=1)``, fused.

    Bit-identical to eager everywhere: where the norm cannot be fused (see the module doc), the norms and the
    concatenation run eagerly and the rotary embedding still runs as the fused, exact `rotary_emb`.

    Args:
        norm_txt: the text part's norm (``attn.norm_added_q``/``norm_added_k``), or None with ``x_txt=None``.
        x_txt: ``[B, S_txt, H, D]`` text queries or keys, or None (single-stream blocks).
        norm_img: the image part's norm (``attn.norm_q``/``norm_k``).
        x_img: ``[B, S_img, H, D]`` image (or, in single-stream blocks, all) queries or keys.
        cos, sin: fp32 ``[S_txt + S_img, D]`` rotary tables.
        site: counters of this fused op at the call site; ``rope_site``: of the `rotary_emb` it falls back to.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import qk_norm_rope, qk_norm_rope_ref
        >>> nt, ni = torch.nn.RMSNorm(8, eps=1e-6), torch.nn.RMSNorm(8, eps=1e-6)
        >>> xt, xi, cos, sin = torch.randn(1, 3, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(8, 8), torch.randn(8, 8)
        >>> with torch.no_grad():
        ...     torch.equal(qk_norm_rope(nt, xt, ni, xi, cos, sin), qk_norm_rope_ref(nt, xt, ni, xi, cos, sin))
        True
    """
    return QK_NORM_ROPE(site, norm_txt, x_txt, norm_img, x_img, cos, sin, rope_site)
