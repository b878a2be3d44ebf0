"""Two projections written straight into their token concatenation: ``cat([linear(a), linear(b)], dim=1)``.

FLUX.1's dual-block attention (``FluxAttnProcessor``, also Chroma's) projects the text and image values apart and
then joins them for attention::

    encoder_value = attn.add_v_proj(encoder_hidden_states)     # [B, T, N]
    value = attn.to_v(hidden_states)                            # [B, S, N]
    value = torch.cat([encoder_value, value], dim=1)            # [B, T + S, N]: a read and a write of both again

At batch 1 the two halves of the joint tensor are contiguous row ranges, so each GEMM can write its rows in place:
the same ``addmm(bias, x.view(-1, K), weight.t())`` that ``F.linear`` runs for a contiguous 3-D input, with the
output given (``out=``) instead of allocated. No kernel of this package's: cuBLASLt's own GEMM with its bias
epilogue, the one eager runs, into a contiguous output whose start is aligned as a fresh allocation's is (aten hands
cuBLASLt the pointers' alignment, up to 256 bytes, as a preference: the guard requires the second half to start on
256 bytes, true at every text length when ``N * itemsize`` is a multiple of 256, FLUX's 3072 x 2 bytes). It removes
the concatenation's copy: at FLUX.1-dev 1024x1024, 19 kernels and 57 MB of traffic each a step.

cuBLASLt chooses its algorithm from the shapes, strides, dtypes and alignments, all kept; it is still a property of
the cuBLAS build, so the op verifies itself: the first call of each signature (dtype, lengths, dims, device) is
compared with eager by ``torch.equal``, and a mismatch disables it for the process with one warning.

The guard admits fp16/bf16 CUDA tensors of batch 1, contiguous inputs ``[1, T, K]`` and ``[1, S, K]``, weights
``[N, K]`` and biases ``[N]`` (not ``None``) of the same dtype, no autograd. Anything else runs the eager
expression, counted with its reason at the call site. Which modules may be read this way (plain ``nn.Linear`` with a
bias, no hooks: not a LoRA or quantized layer, whose forward must run) is the call site's decision (`models.flux`).
``torch.compile`` sees the registered custom op ``diffusers_fastpath::linear_cat`` (with a fake).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._policy import HALF_DTYPES, FusedOp, Site

_OUT_ALIGN = 256  # the largest alignment aten reports to cuBLASLt (Blas.cpp's _getAlignment)
BATCH_REASON = "batch above 1 (each half of the joint tensor is strided)"  # what a batch-2 call site counts


def linear_cat_ref(xa: torch.Tensor, wa: torch.Tensor, ba: torch.Tensor, xb: torch.Tensor, wb: torch.Tensor,
                   bb: torch.Tensor) -> torch.Tensor:
    """The eager expression: ``torch.cat([F.linear(xa, wa, ba), F.linear(xb, wb, bb)], dim=1)``."""
    return torch.cat([F.linear(xa, wa, ba), F.linear(xb, wb, bb)], dim=1)


def _linear_cat_out(xa, wa, ba, xb, wb, bb) -> torch.Tensor:
    """The fused call: each ``addmm`` into its rows of the joint tensor (batch 1)."""
    ta, tb, n = xa.shape[1], xb.shape[1], wa.shape[0]
    out = torch.empty((1, ta + tb, n), dtype=xa.dtype, device=xa.device)
    rows = out.view(ta + tb, n)
    torch.addmm(ba, xa.view(ta, xa.shape[2]), wa.t(), out=rows[:ta])
    torch.addmm(bb, xb.view(tb, xb.shape[2]), wb.t(), out=rows[ta:])
    return out


def _guard(xa, wa, ba, xb, wb, bb, check_pointers: bool = True) -> str | None:
    """``None`` when the projections can be written into the joint tensor, else why not (counted at the call site)."""
    if ba is None or bb is None:
        return "no bias"  # addmm adds one (eager's F.linear without a bias runs another GEMM call)
    dtype = xa.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if any(t.dtype is not dtype for t in (wa, ba, xb, wb, bb)):
        return "mixed dtypes"
    if xa.dim() != 3 or xb.dim() != 3 or wa.dim() != 2 or wb.dim() != 2 or ba.dim() != 1 or bb.dim() != 1:
        return "shape"
    if wa.shape != (ba.shape[0], xa.shape[2]) or wb.shape != (bb.shape[0], xb.shape[2]) or wa.shape[0] != wb.shape[0]:
        return "shape"
    if xa.shape[0] != 1 or xb.shape[0] != 1:
        return BATCH_REASON
    if xa.numel() == 0 or xb.numel() == 0 or wa.numel() == 0:
        return "empty"
    if (xa.shape[1] * wa.shape[0] * xa.element_size()) % _OUT_ALIGN:
        return f"second half not {_OUT_ALIGN}-byte aligned"
    if not (xa.is_contiguous() and xb.is_contiguous()):
        return "input not contiguous"  # F.linear runs matmul, not addmm, for those
    if torch.is_grad_enabled() and any(t.requires_grad for t in (xa, wa, ba, xb, wb, bb)):
        return "requires grad"
    if not xa.is_cuda:
        return f"device {xa.device.type}"
    if any(t.device != xa.device for t in (wa, ba, xb, wb, bb)):
        return "devices differ"
    return None


def _signature(xa, wa, ba, xb, wb, bb) -> tuple:
    """What cuBLASLt's choice of algorithm depends on here: dtype, the two lengths, K of each, N, the device (whose
    index stands for its kind: one process's GPUs of one index do not change)."""
    return (str(xa.dtype).removeprefix("torch."), xa.shape[1], xb.shape[1], xa.shape[2], xb.shape[2], wa.shape[0],
            xa.device.type, xa.device.index)  # plain values: torch.compile traces this too


@torch.library.custom_op("diffusers_fastpath::linear_cat", mutates_args=())
def _linear_cat_op(xa: torch.Tensor, wa: torch.Tensor, ba: torch.Tensor, xb: torch.Tensor, wb: torch.Tensor,
                   bb: torch.Tensor) -> torch.Tensor:
    if _guard(xa, wa, ba, xb, wb, bb) is None:
        return _linear_cat_out(xa, wa, ba, xb, wb, bb)
    return linear_cat_ref(xa, wa, ba, xb, wb, bb)


@_linear_cat_op.register_fake
def _linear_cat_fake(xa, wa, ba, xb, wb, bb):
    torch._check(xa.dim() == 3 and xb.dim() == 3 and xa.shape[0] == xb.shape[0], lambda: "linear_cat: [B, T, K] inputs")
    torch._check(wa.shape[0] == wb.shape[0], lambda: "linear_cat: the two weights disagree on N")
    return xa.new_empty((xa.shape[0], xa.shape[1] + xb.shape[1], wa.shape[0]))


LINEAR_CAT = FusedOp(
    "linear_cat",
    ref=linear_cat_ref,
    guard=_guard,
    kernel=_linear_cat_out,
    custom_op=torch.ops.diffusers_fastpath.linear_cat.default,
    verify_key=_signature,
)


def linear_cat(xa: torch.Tensor, wa: torch.Tensor, ba: torch.Tensor, xb: torch.Tensor, wb: torch.Tensor,
               bb: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``torch.cat([F.linear(xa, wa, ba), F.linear(xb, wb, bb)], dim=1)``, each GEMM writing its rows of the result
    (CUDA, batch 1; self-verified), bit-identical to eager.

    Args:
        xa, xb: ``[1, T, K]`` and ``[1, S, K']`` contiguous activations (text, then image).
        wa, ba, wb, bb: the two ``nn.Linear``'s weights ``[N, K]``, ``[N, K']`` and biases ``[N]``.
        site: the call site's counters (calls on the fused path, fallbacks with reasons), shown by `report`.

    Returns:
        ``[1, T + S, N]``.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import linear_cat, linear_cat_ref
        >>> xa, xb, w, b = torch.randn(1, 4, 8), torch.randn(1, 6, 8), torch.randn(16, 8), torch.randn(16)
        >>> torch.equal(linear_cat(xa, w, b, xb, w, b), linear_cat_ref(xa, w, b, xb, w, b))  # CPU: eager
        True
    """
    return LINEAR_CAT(site, xa, wa, ba, xb, wb, bb)
