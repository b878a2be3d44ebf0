"""A QK norm and complex rotary written straight after a cached prefix: ``torch.cat([c, rope(norm(x), freqs)], dim=1)``.

Qwen-Image 2.1's KV-cached denoising steps (``kv_cache_mode="cached"``) normalise and rotate each block's key, then
put the text prefix cached at the first step in front of it (``_qwenimage21_prepare_qkv``)::

    key = apply_rotary_emb_qwen(attn.norm_k(key).to(value.dtype), rotary_emb, use_real=False)   # [B, S, H, D]
    cached_k, cached_v = layer_cache.get()                                                        # [B, P, H, D]
    key = torch.cat([cached_k, key], dim=1)                                                       # [B, P + S, H, D]

At batch 1 the rows ``[P:]`` of the result are one contiguous block, so the `rmsnorm_rope_complex` kernel (its ``out``
form, `_rmsnorm_rope_complex_cuda_out`) writes the rotated key there and only the prefix is copied: the
concatenation's second read and write of the whole key (1024x1024: 4096 of the 4352 rows, 32 blocks a step) is not
made. The values are the kernel's, which verifies itself as `rmsnorm_rope_complex` does: the first fast call of each
(dtype, D, factor dtype) is compared with eager by ``torch.equal`` (the prefix is a copy, exact by construction),
and a mismatch disables this op for the process with one warning.

The guard admits what `rmsnorm_rope_complex`'s does, at batch 1, with a ``[1, P, H, D]`` prefix of ``x``'s dtype,
heads, head dim and device (any strides: it is copied). Anything else (a batch above 1, where the rows of the result
are strided; a prefix of another shape) runs the concatenation as written, the norm and rotary still through
`rmsnorm_rope_complex` (counted on its own site). Which calls reach this op (the rotary result read by nothing but
the concatenation) is the rewriter's proof (`models._rewriter_attention`, the prefix form). ``torch.compile`` sees the
registered custom op ``diffusers_fastpath::rmsnorm_rope_complex_prefix`` (with a fake).
"""

from __future__ import annotations

import torch

from . import rmsnorm_rope as _rope
from ._policy import FusedOp, Site
from .rmsnorm_rope import _guard as _rope_guard
from .rmsnorm_rope import _pairs, rmsnorm_rope_complex, rmsnorm_rope_complex_ref
from .rmsnorm_scale_shift import _Norm

BATCH_REASON = "batch above 1 (the rows after the prefix are strided)"


def rmsnorm_rope_complex_prefix_ref(prefix: torch.Tensor, norm, x: torch.Tensor, freqs: torch.Tensor,
                                    single_site=None) -> torch.Tensor:
    """The eager chain: the norm and rotary of ``x``, then ``torch.cat([prefix, ...], dim=1)``."""
    return torch.cat([prefix, rmsnorm_rope_complex_ref(norm, x, freqs)], dim=1)


def _fallback(prefix, norm, x, freqs, single_site=None) -> torch.Tensor:
    # the norm and rotary through their own op (fused and self-verified on its own where it can), then the cat
    return torch.cat([prefix, rmsnorm_rope_complex(norm, x, freqs, single_site)], dim=1)


def _guard(prefix, norm, x, freqs, single_site=None, check_pointers: bool = True) -> str | None:
    if not (isinstance(prefix, torch.Tensor) and isinstance(x, torch.Tensor)) or prefix.dim() != 4 or x.dim() != 4:
        return "shape"
    if x.shape[0] != 1 or prefix.shape[0] != 1:
        return BATCH_REASON
    if prefix.shape[2:] != x.shape[2:] or prefix.dtype != x.dtype or prefix.device != x.device:
        return "prefix of other heads, dtype or device"
    if torch.is_grad_enabled() and prefix.requires_grad:
        return "requires grad"
    return _rope_guard(norm, x, freqs, check_pointers)


def _kernel(prefix, norm, x, freqs, single_site=None) -> torch.Tensor:
    _, tokens, heads, dim = x.shape
    length = prefix.shape[1]
    out = x.new_empty(1, length + tokens, heads, dim)
    out[:, :length].copy_(prefix)
    rows = tokens * heads  # batch 1: out[:, length:] is one contiguous [tokens, heads, dim] block
    _rope._launch_out(out[:, length:].view(rows, 1, dim), x.view(rows, 1, dim), norm.weight, _pairs(freqs), heads,
                      tokens, norm.eps)
    return out


@torch.library.custom_op("diffusers_fastpath::rmsnorm_rope_complex_prefix", mutates_args=())
def _rmsnorm_rope_complex_prefix_op(prefix: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor,
                                    eps: float) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _guard(prefix, norm, x, freqs) is None:
        return _kernel(prefix, norm, x, freqs)
    return torch.cat([prefix, torch.ops.diffusers_fastpath.rmsnorm_rope_complex.default(x, weight, freqs, eps)], dim=1)


@_rmsnorm_rope_complex_prefix_op.register_fake
def _(prefix, x, weight, freqs, eps):
    torch._check(prefix.dim() == 4 and x.dim() == 4, lambda: "rmsnorm_rope_complex_prefix: [B, L, H, D] tensors")
    return x.new_empty(x.shape[0], prefix.shape[1] + x.shape[1], *x.shape[2:])


def _custom_op(prefix, norm, x, freqs, single_site=None):
    return torch.ops.diffusers_fastpath.rmsnorm_rope_complex_prefix.default(prefix, x, norm.weight, freqs, norm.eps)


def _signature(prefix, norm, x, freqs, single_site=None):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1], str(freqs.dtype).removeprefix("torch."))


RMSNORM_ROPE_COMPLEX_PREFIX = FusedOp(
    "rmsnorm_rope_complex_prefix",
    ref=rmsnorm_rope_complex_prefix_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=_custom_op,
    verify_key=_signature,
    fallback=_fallback,
    modules=(1,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def rmsnorm_rope_complex_prefix(prefix: torch.Tensor, norm, x: torch.Tensor, freqs: torch.Tensor,
                                site: Site | None = None, single_site: Site | None = None) -> torch.Tensor:
    """``torch.cat([prefix, rope_complex(norm(x), freqs)], dim=1)``: a QK norm and complex rotary (Qwen-Image 2.1's
    key) written by the `rmsnorm_rope_complex` kernel after a copy of the cached `prefix` (batch 1), self-verified per
    (dtype, D, factor dtype), bit-identical to eager everywhere.

    Args:
        prefix: ``[1, P, H, D]`` rows to put first (the KV cache's key), of x's dtype and device.
        norm, x, freqs: as `rmsnorm_rope_complex`'s (a diffusers ``RMSNorm``, ``[1, S, H, D]``, complex factors).
        site: the call site's counters; `single_site`: where the norm and rotary count when this op cannot take the
            call (a batch above 1, say) and they run through `rmsnorm_rope_complex` before the concatenation.

    Example:
        >>> import torch
        >>> from diffusers.models.normalization import RMSNorm
        >>> from diffusers_fastpath.ops.rmsnorm_rope_prefix import (rmsnorm_rope_complex_prefix,
        ...                                                         rmsnorm_rope_complex_prefix_ref)
        >>> norm, prefix, x = RMSNorm(128, eps=1e-6), torch.randn(1, 3, 2, 128), torch.randn(1, 8, 2, 128)
        >>> freqs = torch.polar(torch.ones(8, 64), torch.rand(8, 64))
        >>> out = rmsnorm_rope_complex_prefix(prefix, norm, x, freqs)
        >>> out.shape, torch.equal(out, rmsnorm_rope_complex_prefix_ref(prefix, norm, x, freqs))
        (torch.Size([1, 11, 2, 128]), True)
    """
    return RMSNORM_ROPE_COMPLEX_PREFIX(site, prefix, norm, x, freqs, single_site)
