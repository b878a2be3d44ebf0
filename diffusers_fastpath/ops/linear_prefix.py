"""A projection written straight after a cached prefix: ``torch.cat([c, linear(x).unflatten(-1, sizes)], dim=1)``.

Qwen-Image 2.1's KV-cached denoising steps (``kv_cache_mode="cached"``) project each block's value, then put the text
prefix cached at the first step in front of it (``_qwenimage21_prepare_qkv``)::

    value = attn.to_v(hidden_states)                      # [B, S, N]
    value = value.unflatten(-1, (-1, head_dim))           # [B, S, H, D]
    ...
    cached_k, cached_v = layer_cache.get()                # [B, P, H, D]
    value = torch.cat([cached_v, value], dim=1)           # [B, P + S, H, D]: a read and a write of the value again

At batch 1 the rows ``[P:]`` of the result are one contiguous ``[S, N]`` block, so the GEMM writes them in place: the
same GEMM call that ``F.linear`` makes for a contiguous 3-D input (``mm(x.view(-1, K), weight.t())`` without a bias,
as Qwen-Image 2.1's projections are: ``matmul``'s folded case; ``addmm(bias, ...)`` with one), with the output given
(``out=``) instead of allocated, after a copy of the prefix into rows ``[:P]``. No kernel of this package's: cuBLAS's
own GEMM, as `linear_cat` runs it (the rows ``[P:]`` must start on 256 bytes, as a
fresh allocation does: aten hands cuBLASLt the pointers' alignment; Qwen-Image 2.1's P * N * 2 bytes = 2 MiB). The
concatenation's second read and write of the value (4096 of 4352 rows at 1024x1024, 32 blocks a step) is not made.

cuBLASLt chooses its algorithm from the shapes, strides, dtypes and alignments, all kept; it is still a property of
the cuBLAS build, so the op verifies itself: the first call of each signature (dtype, lengths, K, N, device) is
compared with eager by ``torch.equal``, and a mismatch disables it for the process with one warning.

The guard admits fp16/bf16 CUDA tensors: a plain ``nn.Linear`` (a bias, if any, of x's dtype; no hooks: the policy refuses
a hooked one before the guard, and the eager expression calls the module), a contiguous ``[1, S, K]`` x, a ``[1, P,
*tail]`` prefix of x's dtype and device whose ``tail`` is the projection's unflattened one, no autograd. Anything else
runs the eager expression (the module's call, hooks and all, and ``torch.cat``), counted with its reason at the call
site. Which calls reach this op (a projection that nothing but the concatenation reads, the module called later than
written) is the rewriter's proof and the waiting projection's checks (`models._chain_pending`'s `linear_later`).
``torch.compile`` sees the registered custom op ``diffusers_fastpath::linear_prefix`` (with a fake); the waiting
projection is not made while tracing, so a compiled model runs the lines as written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._policy import HALF_DTYPES, FusedOp, Site

_OUT_ALIGN = 256  # the largest alignment aten reports to cuBLASLt (Blas.cpp's _getAlignment): as `linear_cat`'s
BATCH_REASON = "batch above 1 (the rows after the prefix are strided)"


def unflattened(n: int, sizes) -> tuple[int, ...] | None:
    """The shape ``unflatten(-1, sizes)`` makes of a last dimension of `n` (`sizes` ``None``: ``(n,)``, no unflatten),
    or ``None`` where it would raise: ints, at most one ``-1``, the others positive, their product `n`."""
    if sizes is None:
        return (n,)
    if not isinstance(sizes, (tuple, list)) or not sizes or not all(type(s) is int for s in sizes):
        return None
    known = [s for s in sizes if s != -1]
    if len(sizes) - len(known) > 1 or any(s <= 0 for s in known):
        return None
    product = 1
    for s in known:
        product *= s
    if len(known) == len(sizes):
        return tuple(sizes) if product == n else None
    if n % product:
        return None
    return tuple(n // product if s == -1 else s for s in sizes)


def linear_prefix_ref(prefix: torch.Tensor, linear: nn.Module, x: torch.Tensor, sizes=None) -> torch.Tensor:
    """The eager lines: ``torch.cat([prefix, linear(x).unflatten(-1, sizes)], dim=1)`` (no unflatten where `sizes` is
    ``None``), the module called (its hooks run)."""
    value = linear(x)
    if sizes is not None:
        value = value.unflatten(-1, sizes)
    return torch.cat([prefix, value], dim=1)


def _guard(prefix, linear, x, sizes=None, check_pointers: bool = True) -> str | None:
    """``None`` when the projection can be written after the prefix, else why not (counted at the call site)."""
    if type(linear) is not nn.Linear:
        return "not a plain nn.Linear"
    return _reason(prefix, x, linear.weight, linear.bias, sizes)


def _reason(prefix, x, weight, bias, sizes) -> str | None:
    if not isinstance(prefix, torch.Tensor) or not isinstance(x, torch.Tensor):
        return "not a tensor prefix and x"
    dtype = x.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if weight.dtype is not dtype or (bias is not None and bias.dtype is not dtype):
        return "mixed dtypes"
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[1] != x.shape[2]:
        return "shape"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        return "shape"
    tail = unflattened(weight.shape[0], sizes)
    if tail is None or prefix.dim() != 2 + len(tail) or tuple(prefix.shape[2:]) != tail:
        return "prefix not [B, P, *the value's heads]"
    if x.shape[0] != 1 or prefix.shape[0] != 1:
        return BATCH_REASON
    if prefix.dtype is not dtype:
        return "prefix of another dtype"  # (torch.cat promotes)
    if x.numel() == 0 or weight.numel() == 0:
        return "empty"
    if (prefix.numel() * prefix.element_size()) % _OUT_ALIGN:
        return f"rows after the prefix not {_OUT_ALIGN}-byte aligned"
    if not x.is_contiguous():
        return "input not contiguous"  # F.linear runs matmul, not addmm, for those
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (prefix, x, weight, bias)):
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if any(t is not None and t.device != x.device for t in (prefix, weight, bias)):
        return "devices differ"
    return None


def _out(prefix: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused call (batch 1): the prefix copied into rows ``[:P]``, the GEMM eager's ``F.linear`` runs for a
    contiguous 3-D x into rows ``[P:]`` (``addmm(bias, x2d, weight.t())`` with a bias, its `_flatten_nd_linear`;
    ``mm(x2d, weight.t())`` without, its ``matmul``'s folded 3-D x 2-D case); ``[1, P + S, *prefix's tail]`` (`out`, a
    contiguous tensor of that shape, or a new one)."""
    length, tokens, n = prefix.shape[1], x.shape[1], weight.shape[0]
    if out is None:
        out = torch.empty((1, length + tokens, *prefix.shape[2:]), dtype=x.dtype, device=x.device)
    out[:, :length].copy_(prefix)
    rows = out.view(length + tokens, n)  # (batch 1, contiguous: each token's row of N)
    if bias is None:
        torch.mm(x.view(tokens, x.shape[2]), weight.t(), out=rows[length:])
    else:
        torch.addmm(bias, x.view(tokens, x.shape[2]), weight.t(), out=rows[length:])
    return out


def _kernel(prefix, linear, x, sizes=None) -> torch.Tensor:
    return _out(prefix, x, linear.weight, linear.bias)


@torch.library.custom_op("diffusers_fastpath::linear_prefix", mutates_args=())
def _linear_prefix_op(prefix: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    tail = tuple(prefix.shape[2:])
    if _reason(prefix, x, weight, bias, tail if len(tail) > 1 else None) is None:
        return _out(prefix, x, weight, bias)
    value = F.linear(x, weight, bias)
    return torch.cat([prefix, value.unflatten(-1, tail) if len(tail) > 1 else value], dim=1)


@_linear_prefix_op.register_fake
def _(prefix, x, weight, bias):
    torch._check(prefix.dim() >= 3 and x.dim() == 3, lambda: "linear_prefix: a [B, P, *tail] prefix, a [B, S, K] x")
    return x.new_empty((x.shape[0], prefix.shape[1] + x.shape[1], *prefix.shape[2:]))


def _custom_op(prefix, linear, x, sizes=None):
    return torch.ops.diffusers_fastpath.linear_prefix.default(prefix, x, linear.weight, linear.bias)


def _signature(prefix, linear, x, sizes=None) -> tuple:
    """What cuBLASLt's choice of algorithm depends on here: dtype, the prefix's and x's lengths, K, N, the device
    (`linear_cat`'s, with the prefix's length for the text's)."""
    return (str(x.dtype).removeprefix("torch."), prefix.shape[1], x.shape[1], x.shape[2], linear.weight.shape[0],
            x.device.type, x.device.index)


LINEAR_PREFIX = FusedOp(
    "linear_prefix",
    ref=linear_prefix_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=_custom_op,
    verify_key=_signature,
    modules=(1,),  # the projection whose call the GEMM stands for: its hooks refuse the call
)


def linear_prefix(prefix: torch.Tensor, linear: nn.Module, x: torch.Tensor, sizes=None,
                  site: Site | None = None) -> torch.Tensor:
    """``torch.cat([prefix, linear(x).unflatten(-1, sizes)], dim=1)`` (`sizes` ``None``: no unflatten): the GEMM
    writing its rows after a copy of the prefix (CUDA, batch 1; self-verified), bit-identical to eager.

    Args:
        prefix: ``[1, P, *tail]`` rows to put first (Qwen-Image 2.1's cached value), of x's dtype and device.
        linear: a plain ``nn.Linear`` (``[N, K]``, a ``[N]`` bias or none); x: ``[1, S, K]``, contiguous.
        sizes: the ``unflatten(-1, sizes)`` applied to the projection (``tail``), or ``None``.
        site: the call site's counters (calls on the fused path, fallbacks with reasons), shown by `report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops.linear_prefix import linear_prefix, linear_prefix_ref
        >>> prefix, linear, x = torch.randn(1, 4, 2, 8), torch.nn.Linear(8, 16), torch.randn(1, 6, 8)
        >>> with torch.no_grad():  # CPU: eager
        ...     out = linear_prefix(prefix, linear, x, (-1, 8))
        ...     out.shape, torch.equal(out, linear_prefix_ref(prefix, linear, x, (-1, 8)))
        (torch.Size([1, 10, 2, 8]), True)
    """
    return LINEAR_PREFIX(site, prefix, linear, x, sizes)
