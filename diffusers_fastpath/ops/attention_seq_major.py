"""SD3's joint attention on token-major operands: the image and text q, k and v concatenated as ``[B, S, H, D]``
memory (the layout of the projections they are views of), so that the attention writes its output token-major too
and the processor's ``transpose(1, 2).reshape(B, S, H * D)`` after it is a view instead of a copy.

Eager (``JointAttnProcessor2_0``)::

    query = torch.cat([query, encoder_hidden_states_query_proj], dim=2)   # likewise key and value: each operand a
                                                                          # [B, H, S, D] view of [B, S, H, D] memory,
                                                                          # the result contiguous [B, H, S, D]
    hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
    hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)   # a copy

Here each concatenation is ``torch.cat([a.transpose(1, 2), b.transpose(1, 2)], dim=1).transpose(1, 2)``: the same
values (a copy computes nothing), read and written as whole contiguous rows. torch's cuDNN, flash and
memory-efficient attention allocate their output in q's layout (cuDNN: ``alloc_with_matching_layout`` in
``aten/src/ATen/native/cudnn/MHA.cpp``), so the output comes out ``[B, S, H, D]`` in memory and the reshape after
it copies nothing: 40 copies of 22-30 µs, 1.2 ms of an SD3.5-large step at 1024x1024 on the H200.

Whether an attention kernel computes the same values from the other layout is a property of that kernel (on the
H200 with torch 2.11 every backend did, for SD3.5's and FLUX's shapes, bf16 and fp16:
``tools/attention_layout_probe.py``), so the op verifies itself: the first call of each signature (the attention
function, dtype, device, shapes, its arguments and torch's SDPA backend settings) also runs the attention on
contiguous copies, eager's layout, and compares the two by ``torch.equal``; a mismatch disables the op for the process
with one warning, that call returns the eager-layout result, and from then on the concatenations are eager's
layout again (`diffusers_fastpath.ops.cat_heads`). Only the processor's own ``transpose(1, 2).reshape(...)`` reads
the output (the rewriter checks that), and it gives the same contiguous tensor from either layout.

The guard takes fp16/bf16 CUDA operands that are token-major views (``x.transpose(1, 2)`` contiguous), attention
arguments without dropout or mask, no autograd (a backward's kernels choose by layout too), not under
``torch.compile`` (which traces the concatenations as written).
"""

from __future__ import annotations

import torch

from ._policy import HALF_DTYPES, REASON_ENV, REASON_TRANSFORM, FusedOp, Site

_SEQ_MAJOR = "_fastpath_seq_major"  # the mark a token-major concatenation's output carries to the attention
_ARGUMENTS = frozenset({"dropout_p", "is_causal", "scale"})  # the keyword arguments the op passes on


def _operand_reason(t, check_pointers: bool = True) -> str | None:
    """Why `t` cannot be one concatenation operand or output of the token-major form, or ``None``."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return "shape"
    if t.dtype not in HALF_DTYPES:
        return f"dtype {str(t.dtype).removeprefix('torch.')}"
    if t.shape[1] < 2:  # one head: torch.cat may keep a layout it takes for channels-last; eager's is contiguous here
        return "one head"
    if torch.is_grad_enabled() and t.requires_grad:
        return "requires grad"
    if not t.transpose(1, 2).is_contiguous():
        return "not a token-major view"
    if not t.is_cuda:
        return f"device {t.device.type}"
    return None


def cat_reason(a, b) -> str | None:
    """``None`` where ``torch.cat([a, b], dim=2)`` may be written token-major for the attention after it, else why
    not (the op disabled or switched off, the operands' layout, ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    if torch._C._are_functorch_transforms_active():
        return REASON_TRANSFORM  # the attention refuses there too: eager's layout
    if ATTENTION_SEQ_MAJOR.env_disabled:
        return REASON_ENV
    if ATTENTION_SEQ_MAJOR.disabled is not None:
        return ATTENTION_SEQ_MAJOR.disabled_reason
    for t in (a, b):
        reason = ATTENTION_SEQ_MAJOR_GUARD(t)
        if reason is not None:
            return reason
    if a.shape[0] != b.shape[0] or a.shape[1] != b.shape[1] or a.shape[3] != b.shape[3]:
        return "shape"
    if a.dtype != b.dtype or a.device != b.device:
        return "mixed dtypes or devices"
    return None


def cat_seq_major(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.cat([a, b], dim=2)`` of two ``[B, H, S, D]`` token-major views, written token-major (the same values,
    ``[B, H, Sa + Sb, D]`` whose memory is ``[B, Sa + Sb, H, D]``), marked for `attention_seq_major`."""
    out = torch.cat([a.transpose(1, 2), b.transpose(1, 2)], dim=1).transpose(1, 2)
    setattr(out, _SEQ_MAJOR, True)
    return out


def attention_seq_major_ref(fn, q, k, v, arguments: tuple) -> torch.Tensor:
    """The eager attention: `fn` on the operands in eager's layout (contiguous ``[B, H, S, D]``, as ``torch.cat``
    writes them)."""
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), **dict(arguments))


def _kernel(fn, q, k, v, arguments: tuple) -> torch.Tensor:
    return fn(q, k, v, **dict(arguments))


_SDPA = torch.nn.functional.scaled_dot_product_attention  # torch's own (what `fn` is unless a library replaced it)


def _guard(fn, q, k, v, arguments: tuple, check_pointers: bool = True) -> str | None:
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    if fn is not _SDPA:  # a replacement is user code: its self-check would run it twice, and its layouts are its own
        return "attention is not torch's scaled_dot_product_attention"
    names = {name for name, _ in arguments}
    if not names <= _ARGUMENTS or dict(arguments).get("dropout_p", 0.0) != 0.0:
        return "arguments"
    for t in (q, k, v):
        reason = ATTENTION_SEQ_MAJOR_GUARD(t)
        if reason is not None:
            return reason
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        return "mixed dtypes or devices"
    return None


def _backends() -> tuple:
    """torch's SDPA settings that choose the attention kernel (the flags ``torch.nn.attention.sdpa_kernel`` sets)."""
    cuda = torch.backends.cuda
    flags = (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
             cuda.cudnn_sdp_enabled())
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    return flags + (tuple(order()) if order is not None else ())


def _signature(fn, q, k, v, arguments: tuple):
    return (getattr(fn, "__qualname__", repr(fn)), str(q.dtype).removeprefix("torch."), str(q.device),
            tuple(q.shape), tuple(k.shape), tuple(v.shape), arguments, _backends())


ATTENTION_SEQ_MAJOR = FusedOp(
    "attention_seq_major",
    ref=attention_seq_major_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=None,  # never traced: under torch.compile the concatenations are written as eager's (`cat_reason`)
    verify_key=_signature,
)
ATTENTION_SEQ_MAJOR_GUARD = _operand_reason  # what the op and `cat_reason` ask of each operand (tests: as on CUDA)


def seq_major(t) -> bool:
    """Whether `t` is a concatenation `cat_seq_major` wrote (token-major where eager's is contiguous)."""
    return getattr(t, _SEQ_MAJOR, False) is True


def attention_seq_major(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, site: Site | None = None,
                        **arguments) -> torch.Tensor:
    """``fn(q, k, v, **arguments)`` (an attention, ``F.scaled_dot_product_attention``) of operands that `cat_seq_major`
    wrote token-major: on them as they are where verified (the output then token-major too), else on contiguous
    copies, as eager's layout. Bit-identical to eager either way.

    Args:
        fn: the attention function the processor calls.
        q, k, v: ``[B, H, S, D]``.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        arguments: the processor's keyword arguments (``dropout_p=0.0``, ``is_causal``, ``scale``).
    """
    return ATTENTION_SEQ_MAJOR(site, fn, q, k, v, tuple(sorted(arguments.items())))
