"""FLUX's QK RMSNorm, the text/image concatenation and the rotary embedding of q or k in one pass.

Eager (``FluxAttnProcessor``, T = bf16 or fp16, ``norm_*`` are ``torch.nn.RMSNorm(head_dim)`` with weights)::

    y = norm_img(x_img)                                   # single blocks: only this source
    y = torch.cat([norm_txt(x_txt), y], dim=1)            # dual blocks: text first
    out = apply_rotary_emb(y, (cos, sin), sequence_dim=1)

The kernel (``csrc/rotary.cu``) reads each source once and writes ``out`` once. The rotary part is exact by
construction (see `rotary_emb`); the norm reproduces what torch runs for ``torch.nn.RMSNorm`` on CUDA when the weight
has the input's dtype: ``aten::rms_norm`` -> ``_fused_rms_norm`` -> ``_fused_rms_norm_cuda``
(``aten/src/ATen/native/layer_norm.cpp``, ``rms_norm_symint``; ``aten/src/ATen/native/cuda/layer_norm_kernel.cu``,
``vectorized_layer_norm_kernel<T, float, rms_norm=true>`` with block (32, 4) and four elements per lane). Its sum of
squares is a per-lane FMA chain over four elements, then a shuffle-down tree (16, 8, 4, 2, 1), then ``/ D``,
``+ eps``, ``rsqrtf``, and ``round(w * (rstd * x))`` (every step is in ``csrc/rotary.cu``; read off the sm_90 SASS
of torch 2.11.0+cu130's kernel, bf16 and fp16). That order belongs to the aten build, so the op verifies itself:
the first fast call of each (dtype, head_dim) is compared with the eager chain by ``torch.equal``; on a mismatch the op is disabled for the process with one warning, and its calls run the
norms and the concatenation eagerly followed by the exact fused `rotary_emb`, so only the norm fusion is lost.

The guard admits what takes aten's vectorised kernel: exactly ``torch.nn.RMSNorm`` (no hooks, weight of the input's
dtype, explicit eps), head_dim a multiple of 4 up to 128, sources with unit innermost stride and 8-byte aligned rows
(aten copies a strided input to a contiguous one first, which does not change the result), no autograd.

`qk_norm_rows_rope` is the same fusion for the QK norms across all heads (LTX-Video, Wan: ``torch.nn.RMSNorm(C)``
of each ``[B, S, C]`` row of q or k, then the model's own rotary), through the same kernel's row norm: aten's
(32, 4) block per row for C > 128 (``csrc/rotary.cu``; ``tools/rms_norm_order_probe.py`` shows the order on the
GPU), self-verified per (dtype, C, form) the same way, falling back to the norm as written and the exact fused rotary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site
from .rotary import (_x_reason, cos_sin_reason, guard_rows, guard_wan, nvrtc_rotary, rotary_emb, rotary_emb_ref,
                     rotary_emb_rows, rotary_emb_rows_ref, rotary_emb_wan, rotary_emb_wan_ref, rows_head_dim, rows_ok,
                     rows_tables_reason)

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
    )  # hooks: the policy refuses a hooked norm before this guard (`FusedOp` ``modules``)


def plain_norm_reason(norm, dim: int, dtype: torch.dtype) -> str | None:
    """Why `norm` is not one the fused row norms reproduce for rows of `dim` elements of `dtype` (`_plain_rms_norm`,
    its weight of that dtype), or ``None``."""
    if not _plain_rms_norm(norm, dim):
        return "norm not a plain torch.nn.RMSNorm with weight"
    if norm.weight.dtype is not dtype:
        return "norm weight dtype differs"  # aten then takes its composite path, another reduction
    return None


def _guard(norm_txt, x_txt, norm_img, x_img, cos, sin, rope_site=None, check_pointers: bool = True,
           fp32_norm: bool = False) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site).
    `fp32_norm`: the norms run on ``x.float()`` with float32 weights (`qk_norm_rope_fp32`, FLUX.3)."""
    dtype = x_img.dtype
    weight_dtype, weight_align = (torch.float32, 16) if fp32_norm else (dtype, 8)
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
    if any(norm.weight.dtype is not weight_dtype for norm, _ in sources):
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
    if reason is None and check_pointers and any(x.data_ptr() % 8 or norm.weight.data_ptr() % weight_align
                                                 for norm, x in sources):
        # aten's vectorised kernel needs 4-element aligned rows and weight too (of x.float() a fresh allocation)
        return "not 8-byte aligned" if weight_align == 8 else "not aligned (x 8 bytes, float32 weight 16)"
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

_cuda_op = LazyLauncher(_nvrtc_kernel, "_qk_norm_rope_cuda")


def _kernel(norm_txt, x_txt, norm_img, x_img, cos, sin, rope_site=None) -> torch.Tensor:
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
    modules=(0, 2),  # the norms whose calls the kernel stands for: their hooks refuse the call
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


# ------------------------------------------------------------------------------------------ across all heads
# LTX-Video's and Wan's self-attention processors (their adapters check the rotary functions by digest)::
#
#     query = attn.norm_q(query)                      # torch.nn.RMSNorm(C) over [B, S, C], all heads
#     query = apply_rotary_emb(query, (cos, sin))     # LTX-Video: its rows form, tables [B or 1, S, C]
#     query = apply_rotary_emb(query.unflatten(2, (heads, -1)), cos, sin)   # Wan: its pairing, tables [1, S, 1, D]
#
# `heads` 0 names LTX-Video's form, else Wan's with that many heads.

# How the row norm's sum of squares becomes the mean square (csrc/rotary.cu's kFinal*: 0 an IEEE division, 1 the
# product with the rounded reciprocal, 2 that product and + eps as one FMA), as tools/rms_norm_order_probe.py finds
# it for the aten build; the first call of each signature checks it against eager all the same.
ROW_NORM_FINAL = 0
MAX_ROW_CHANNELS = 8192  # csrc/rotary.cu's row norm: 128 threads of at most 16 four-element vectors each
ROW_THREADS = 128  # ... its block, aten's (32, 4)


def qk_norm_rows_rope_ref(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int = 0,
                          rope_site=None) -> torch.Tensor:
    """The eager chain: the norm module, then LTX-Video's rotary (``heads=0``) or Wan's over `heads` heads."""
    y = norm(x)
    if heads:
        return rotary_emb_wan_ref(y.unflatten(2, (heads, -1)), cos, sin)
    return rotary_emb_rows_ref(y, cos, sin)


def _rows_fallback(norm, x, cos, sin, heads=0, rope_site=None) -> torch.Tensor:
    # the norm as written, the rotary still fused (exact by construction)
    y = norm(x)
    if heads:
        return rotary_emb_wan(y.unflatten(2, (heads, -1)), cos, sin, rope_site)
    return rotary_emb_rows(y, cos, sin, rope_site)


def _rows_guard(norm, x, cos, sin, heads=0, rope_site=None, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if x.dim() != 3 or (heads and x.shape[2] % heads):
        return "shape"
    channels = x.shape[2]
    if channels > MAX_ROW_CHANNELS:
        return "C above the row norm's registers"
    reason = plain_norm_reason(norm, channels, x.dtype)
    if reason is not None:
        return reason
    weight = norm.weight
    if heads:
        reason = guard_wan(x.unflatten(2, (heads, -1)), cos, sin, check_pointers)
        if reason is None and (4 * ROW_THREADS) % (channels // heads):
            reason = "head_dim does not divide 512"  # the kernel's Wan form: one table quad per thread for all
    else:
        reason = guard_rows(x, cos, sin, check_pointers)
    if reason is not None:
        return reason
    if torch.is_grad_enabled() and weight.requires_grad:
        return "requires grad"
    if weight.device != x.device:
        return "devices differ"
    if not weight.is_contiguous():
        return "norm weight strided"
    if check_pointers and (x.data_ptr() % 8 or weight.data_ptr() % 8):
        return "not 8-byte aligned"  # aten's vectorised kernel needs 8-byte aligned rows and weight
    return None


def _nvrtc_rows_kernel(x, weight, eps, cos, sin, wan, norm_final) -> torch.Tensor:
    # bindings.cpp's qk_norm_rows_rope on the NVRTC way: csrc/rotary.cu's kernel with the row norm (see ops/rotary.py)
    return nvrtc_rotary(None, None, 0.0, x, weight, eps, cos, sin, False, wan=wan, norm_rows=True,
                        norm_final=norm_final)


def _raw_rows_guard(x, weight, eps, cos, sin, wan, norm_final):
    # the raw op's x is [B, S, H, D] (the Python op's split), its tables [S, D] (Wan) or [B or 1, S, H * D]
    if x.dtype not in HALF_DTYPES or x.dim() != 4 or norm_final not in (0, 1, 2):
        return "dtype, shape or norm_final"
    reason = _x_reason(x)
    if reason is not None:
        return reason
    batch, seq, heads, dim = x.shape
    if heads * dim > MAX_ROW_CHANNELS or (wan and (4 * ROW_THREADS) % dim):
        return "C above the row norm's registers, or a Wan head_dim that does not divide 512"
    if (weight.dim() != 1 or weight.shape[0] != heads * dim or weight.dtype is not x.dtype or weight.device != x.device
            or not weight.is_contiguous() or weight.data_ptr() % 8 or x.data_ptr() % 8):
        return "weight"
    if wan:
        return cos_sin_reason(cos, sin, seq, dim, x.device, True)
    return rows_tables_reason(cos, sin, batch, seq, heads * dim, x.device, True)


_nvrtc.raw_op("_qk_norm_rows_rope_cuda",
              "(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin, bool wan, int norm_final) -> Tensor",
              _raw_rows_guard, _nvrtc_rows_kernel)

_cuda_rows_op = LazyLauncher(_nvrtc_rows_kernel, "_qk_norm_rows_rope_cuda")


def _rows_kernel(norm, x, cos, sin, heads=0, rope_site=None, norm_final: int | None = None) -> torch.Tensor:
    final = ROW_NORM_FINAL if norm_final is None else norm_final
    if heads:  # Wan: the guard checked [1, S, 1, D] contiguous tables
        split = x.unflatten(2, (heads, -1))
        seq, dim = split.shape[1], split.shape[3]
        return _cuda_rows_op(split, norm.weight, norm.eps, cos.view(seq, dim), sin.view(seq, dim), True, final)
    dim = rows_head_dim(x.shape[2])
    split = x.unflatten(2, (x.shape[2] // dim, dim))
    return _cuda_rows_op(split, norm.weight, norm.eps, cos, sin, False, final).flatten(2)


@torch.library.custom_op("diffusers_fastpath::qk_norm_rows_rope", mutates_args=())
def _qk_norm_rows_rope_op(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                          heads: int) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _rows_guard(norm, x, cos, sin, heads) is None:
        return _rows_kernel(norm, x, cos, sin, heads)
    return qk_norm_rows_rope_ref(norm, x, cos, sin, heads).contiguous()


@_qk_norm_rows_rope_op.register_fake
def _qk_norm_rows_rope_fake(x, weight, eps, cos, sin, heads):
    torch._check(x.dim() == 3, lambda: f"qk_norm_rows_rope: x must be [B, S, C], got {tuple(x.shape)}")
    if heads:
        return x.new_empty((x.shape[0], x.shape[1], heads, x.shape[2] // heads))
    return x.new_empty(x.shape)


def _rows_custom_op(norm, x, cos, sin, heads=0, rope_site=None) -> torch.Tensor:
    return torch.ops.diffusers_fastpath.qk_norm_rows_rope.default(x, norm.weight, norm.eps, cos, sin, heads)


def _rows_signature(norm, x, cos, sin, heads=0, rope_site=None):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1], "wan" if heads else "rows")


QK_NORM_ROWS_ROPE = FusedOp(
    "qk_norm_rows_rope",
    ref=qk_norm_rows_rope_ref,
    guard=_rows_guard,
    kernel=_rows_kernel,
    custom_op=_rows_custom_op,
    verify_key=_rows_signature,
    fallback=_rows_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def qk_norm_rows_rope(norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int = 0,
                      site: Site | None = None, rope_site: Site | None = None) -> torch.Tensor:
    """``apply_rotary_emb(norm(x), ...)`` of LTX-Video (``heads=0``) or Wan (`heads` its head count), fused.

    Bit-identical to eager everywhere: where the norm cannot be fused (see the module doc), it runs as written and
    the rotary embedding still runs fused and exact (`rotary_emb_rows`, `rotary_emb_wan`).

    Args:
        norm: the QK norm, ``torch.nn.RMSNorm(C)`` across all heads (``attn.norm_q``/``norm_k``).
        x: ``[B, S, C]`` queries or keys, before the norm.
        cos, sin: fp32 tables: LTX-Video's ``[B or 1, S, C]``, Wan's ``[1, S, 1, D]``.
        heads: 0 for LTX-Video's rotary over the rows (the result ``[B, S, C]``), else Wan's over the rows split into
            `heads` heads of ``C / heads`` (the result ``[B, S, heads, C / heads]``).
        site: counters of this fused op at the call site; ``rope_site``: of the rotary it falls back to.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import qk_norm_rows_rope, qk_norm_rows_rope_ref
        >>> norm, x = torch.nn.RMSNorm(16, eps=1e-6), torch.randn(1, 5, 16)
        >>> cos, sin = torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)
        >>> with torch.no_grad():
        ...     torch.equal(qk_norm_rows_rope(norm, x, cos, sin, 2), qk_norm_rows_rope_ref(norm, x, cos, sin, 2))
        True
    """
    return QK_NORM_ROWS_ROPE(site, norm, x, cos, sin, heads, rope_site)


# ------------------------------------------------------------------------------------------ q and k together
# LTX-Video's processor rotates q and then k with one pair of tables (fp32 ``[B or 1, S, C]``: four times the bytes
# of q); the pair form reads them once for both (csrc/rotary.cu's row-norm pair), for rows of up to 4096 elements.

MAX_PAIR_CHANNELS = 4096  # csrc/rotary.cu's pair: 128 threads of at most 8 four-element vectors of each of q and k


def qk_norm_rows_rope_pair_ref(norm_q, q, norm_k, k, cos, sin, rope_site=None):
    """The eager chain of q, then of k: each norm module, then LTX-Video's rotary."""
    return qk_norm_rows_rope_ref(norm_q, q, cos, sin), qk_norm_rows_rope_ref(norm_k, k, cos, sin)


def _pair_fallback(norm_q, q, norm_k, k, cos, sin, rope_site=None):
    # each on its own fused op (itself self-verified, with its own fallback keeping the rotary fused)
    return (qk_norm_rows_rope(norm_q, q, cos, sin, 0, None, rope_site),
            qk_norm_rows_rope(norm_k, k, cos, sin, 0, None, rope_site))


def _pair_guard(norm_q, q, norm_k, k, cos, sin, rope_site=None, check_pointers: bool = True) -> str | None:
    """``None`` when the pair kernel takes these inputs, else the reason it does not (counted at the call site)."""
    if q.shape != k.shape or q.dtype is not k.dtype:
        return "q and k differ in shape or dtype"
    if q.dim() == 3 and q.shape[2] > MAX_PAIR_CHANNELS:
        return "C above the pair's registers"
    return (_rows_guard(norm_q, q, cos, sin, 0, None, check_pointers)
            or _rows_guard(norm_k, k, cos, sin, 0, None, check_pointers))


def _nvrtc_pair_kernel(q, weight_q, eps_q, k, weight_k, eps_k, cos, sin, norm_final) -> torch.Tensor:
    # bindings.cpp's qk_norm_rows_rope_pair on the NVRTC way (see ops/rotary.py)
    return nvrtc_rotary(k, weight_k, eps_k, q, weight_q, eps_q, cos, sin, False, norm_rows=True, norm_final=norm_final)


def _raw_pair_guard(q, weight_q, eps_q, k, weight_k, eps_k, cos, sin, norm_final):
    if q.shape != k.shape or q.dim() != 4 or q.shape[2] * q.shape[3] > MAX_PAIR_CHANNELS:
        return "q and k differ, or rows above 4096"
    return (_raw_rows_guard(q, weight_q, eps_q, cos, sin, False, norm_final)
            or _raw_rows_guard(k, weight_k, eps_k, cos, sin, False, norm_final))


_nvrtc.raw_op("_qk_norm_rows_rope_pair_cuda",
              "(Tensor q, Tensor weight_q, float eps_q, Tensor k, Tensor weight_k, float eps_k, Tensor cos, "
              "Tensor sin, int norm_final) -> Tensor", _raw_pair_guard, _nvrtc_pair_kernel)

_cuda_pair_op = LazyLauncher(_nvrtc_pair_kernel, "_qk_norm_rows_rope_pair_cuda")


def _pair_stacked(norm_q, q, norm_k, k, cos, sin, norm_final: int | None = None) -> torch.Tensor:
    """The kernel's ``[2, B, S, C]`` result (q's, then k's)."""
    final = ROW_NORM_FINAL if norm_final is None else norm_final
    dim = rows_head_dim(q.shape[2])
    q4, k4 = (x.unflatten(2, (x.shape[2] // dim, dim)) for x in (q, k))
    return _cuda_pair_op(q4, norm_q.weight, norm_q.eps, k4, norm_k.weight, norm_k.eps, cos, sin, final).flatten(3)


def _pair_kernel(norm_q, q, norm_k, k, cos, sin, rope_site=None, norm_final: int | None = None):
    out = _pair_stacked(norm_q, q, norm_k, k, cos, sin, norm_final)
    return out[0], out[1]  # two contiguous [B, S, C] views, as eager's two results


@torch.library.custom_op("diffusers_fastpath::qk_norm_rows_rope_pair", mutates_args=())
def _qk_norm_rows_rope_pair_op(q: torch.Tensor, weight_q: torch.Tensor, eps_q: float, k: torch.Tensor,
                               weight_k: torch.Tensor, eps_k: float, cos: torch.Tensor,
                               sin: torch.Tensor) -> torch.Tensor:
    norm_q, norm_k = _Norm(weight_q, eps_q), _Norm(weight_k, eps_k)
    if _pair_guard(norm_q, q, norm_k, k, cos, sin) is None:
        return _pair_stacked(norm_q, q, norm_k, k, cos, sin)
    return torch.stack(qk_norm_rows_rope_pair_ref(norm_q, q, norm_k, k, cos, sin))


@_qk_norm_rows_rope_pair_op.register_fake
def _qk_norm_rows_rope_pair_fake(q, weight_q, eps_q, k, weight_k, eps_k, cos, sin):
    torch._check(q.dim() == 3 and k.shape == q.shape,
                 lambda: "qk_norm_rows_rope_pair: q and k must be [B, S, C] of one shape")
    return q.new_empty((2, *q.shape))


def _pair_custom_op(norm_q, q, norm_k, k, cos, sin, rope_site=None):
    out = torch.ops.diffusers_fastpath.qk_norm_rows_rope_pair.default(q, norm_q.weight, norm_q.eps, k, norm_k.weight,
                                                                      norm_k.eps, cos, sin)
    return out[0], out[1]


def _pair_signature(norm_q, q, norm_k, k, cos, sin, rope_site=None):
    return (str(q.dtype).removeprefix("torch."), q.shape[-1], "rows-pair")


QK_NORM_ROWS_ROPE_PAIR = FusedOp(
    "qk_norm_rows_rope_pair",
    ref=qk_norm_rows_rope_pair_ref,
    guard=_pair_guard,
    kernel=_pair_kernel,
    custom_op=_pair_custom_op,
    verify_key=_pair_signature,
    fallback=_pair_fallback,
    modules=(0, 2),  # the norms whose calls the kernel stands for: their hooks refuse the call
)


def qk_norm_rows_rope_pair(norm_q, q: torch.Tensor, norm_k, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           site: Site | None = None, rope_site: Site | None = None):
    """LTX-Video's ``apply_rotary_emb(norm_q(q), (cos, sin))`` and ``apply_rotary_emb(norm_k(k), (cos, sin))``,
    fused into one kernel that reads the tables once; bit-identical to eager everywhere (where the pair cannot run,
    each runs as `qk_norm_rows_rope`).

    Args:
        norm_q, norm_k: the QK norms, ``torch.nn.RMSNorm(C)`` across all heads.
        q, k: ``[B, S, C]`` queries and keys before their norms (C at most 4096 for the pair kernel).
        cos, sin: LTX-Video's fp32 ``[B or 1, S, C]`` tables.
        site: counters of this fused op at the call site (one count for q and k); ``rope_site``: of the rotary the
            single ops fall back to.

    Returns:
        ``(q_out, k_out)``, each ``[B, S, C]``.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import qk_norm_rows_rope_pair, qk_norm_rows_rope_pair_ref
        >>> nq, nk, q, k = torch.nn.RMSNorm(16, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-6), *torch.randn(2, 1, 5, 16)
        >>> cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
        >>> with torch.no_grad():
        ...     got = qk_norm_rows_rope_pair(nq, q, nk, k, cos, sin)
        ...     ref = qk_norm_rows_rope_pair_ref(nq, q, nk, k, cos, sin)
        >>> all(torch.equal(g, r) for g, r in zip(got, ref))
        True
    """
    return QK_NORM_ROWS_ROPE_PAIR(site, norm_q, q, norm_k, k, cos, sin, rope_site)
