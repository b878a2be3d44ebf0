"""LayerNorm with the adaLN modulate folded into its affine, one kernel (the "high" tier, not bit-exact).

The FLUX adaLN chain ``norm(x) * (1 + scale[:, None]) + shift[:, None]`` (``norm`` a LayerNorm without an affine of
its own) is, for one sample, a LayerNorm whose weight is ``1 + scale`` and whose bias is ``shift``::

    out = F.layer_norm(x, (D,), weight=(1 + scale).reshape(-1), bias=shift.reshape(-1), eps=eps)

one read and one write of ``x`` instead of the lossless path's LayerNorm plus modulate.

Rounding (T the storage dtype, bf16 or fp16): ``1 + scale`` is rounded to T exactly as eager rounds it; the
LayerNorm kernel then computes ``(x - mean) * rstd * w + b`` in fp32 and rounds once, where the lossless chain rounds
three times (the normalised value, the product, the sum). The results differ in the last place: measured with the CPU
LayerNorm (the same fp32 formula and single rounding as the CUDA one) on random bf16 data at (1, 4096, 3072), 31%
of the outputs differ, by at most one ulp (0.125 at outputs of 16-18), and the fold is the more accurate of the two
against a float64 reference (rms error 0.0038 against 0.0052; max 0.082 against 0.132). fp16: max difference
0.0156, rms error 0.00050 against 0.00066. The contract against the lossless path is that of the seed's
``fused_ln_modulate`` (max abs diff ~0.05 measured there on an H200)::

    torch.testing.assert_close(out, lossless, atol=0.0625, rtol=0.05)

(scale and shift were N(0, 1) there, so the outputs reach about 20; an ulp of a bf16 value is at most 2^-7 of it).

Guard, per call: one sample (``B == 1``: the folded affine is a single ``[D]`` row shared by every token, while
with ``B > 1`` each sample has its own row), bf16/fp16, ``[1, L, D]`` activations with ``[1, D]`` scale/shift
(``emb.chunk`` views are fine: ``shift.reshape(-1)`` is a view and ``1 + scale`` a new tensor), a LayerNorm without
an affine of its own, no autograd, CUDA. Any other call takes the lossless path, `layer_norm_affine_ref` (the
LayerNorm module, then the bit-exact `modulate_scale_shift`), and is counted as a fallback with its reason.

``torch.compile`` sees the registered custom op ``diffusers_fastpath::layer_norm_affine`` (with a fake).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._policy import HALF_DTYPES, FusedOp, Site
from .layernorm_scale_shift import layernorm_scale_shift

# Where the fold runs. On other devices the lossless path runs (the tier's contract is stated and tested for CUDA).
_DEVICE_TYPES = ("cuda",)

# The contract against the lossless path (bf16/fp16), stated here once and asserted by the tests.
ATOL = 0.0625
RTOL = 0.05


def layer_norm_affine_ref(norm: torch.nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor):
    """The lossless path this op approximates: the bit-exact fused LayerNorm + modulate (``torch.equal`` to
    diffusers' ``norm(x) * (1 + scale[:, None]) + shift[:, None]``)."""
    return layernorm_scale_shift(norm, x, scale, shift)


def folded_layer_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """The fold itself, for one sample (``x`` ``[1, L, D]``, ``scale``/``shift`` ``[1, D]``): one LayerNorm kernel."""
    return F.layer_norm(x, x.shape[-1:], (1 + scale).reshape(-1), shift.reshape(-1), eps)


def _guard(norm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the fold takes this call, else why not (the call then takes the lossless path)."""
    if norm.weight is not None or norm.bias is not None:
        return "LayerNorm has its own affine"
    dtype = x.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if scale.dtype is not dtype or shift.dtype is not dtype:
        return "mixed dtypes"
    if x.dim() != 3 or scale.dim() != 2 or shift.dim() != 2:
        return "shape"
    batch, _, dim = x.shape
    if tuple(norm.normalized_shape) != (dim,) or scale.shape[1] != dim or shift.shape[1] != dim:
        return "shape"
    if batch != 1 or scale.shape[0] != 1 or shift.shape[0] != 1:
        return f"batch {batch} (the folded affine is one row)"
    if x.numel() == 0:
        return "empty"
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or shift.requires_grad):
        return "requires grad"
    if x.device.type not in _DEVICE_TYPES:
        return f"device {x.device.type}"
    if scale.device != x.device or shift.device != x.device:
        return "devices differ"
    return None


def _kernel(norm, x, scale, shift):
    return folded_layer_norm(x, scale, shift, norm.eps)


@torch.library.custom_op("diffusers_fastpath::layer_norm_affine", mutates_args=())
def _layer_norm_affine_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    # Emitted under torch.compile only where the guard allows (one sample); the fold is valid on every device.
    return folded_layer_norm(x, scale, shift, eps)


@_layer_norm_affine_op.register_fake
def _layer_norm_affine_fake(x, scale, shift, eps):
    torch._check(x.dim() == 3 and x.shape[0] == 1, lambda: f"layer_norm_affine: x must be [1, L, D], got {tuple(x.shape)}")
    torch._check(
        tuple(scale.shape) == (1, x.shape[2]) and tuple(shift.shape) == (1, x.shape[2]),
        lambda: "layer_norm_affine: scale/shift must be [1, D]",
    )
    return torch.empty_like(x, memory_format=torch.contiguous_format)


LAYER_NORM_AFFINE = FusedOp(
    "layer_norm_affine",
    ref=layer_norm_affine_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=lambda norm, x, scale, shift: torch.ops.diffusers_fastpath.layer_norm_affine.default(
        x, scale, shift, norm.eps
    ),
)


def layer_norm_affine(
    norm: torch.nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, site: Site | None = None
) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]`` as one LayerNorm with a folded affine ("high" tier).

    Close to the lossless path, not bit-identical: ``assert_close(out, lossless, atol=ATOL, rtol=RTOL)`` (0.0625,
    0.05) in bf16/fp16. Calls the guard rejects (``B > 1``, fp32, CPU, autograd) run the lossless path exactly.

    Args:
        norm: the adaLN ``nn.LayerNorm`` (no affine of its own; its ``eps`` is used, and it runs on fallback).
        x: ``[1, L, D]`` activations.
        scale: ``[1, D]`` modulation scale (e.g. a view from ``emb.chunk(6, dim=1)``).
        shift: ``[1, D]`` modulation shift.
        site: the call site's counters (calls on the folded path, fallbacks with reasons), shown by `report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import layer_norm_affine, layer_norm_affine_ref
        >>> norm = torch.nn.LayerNorm(64, elementwise_affine=False, eps=1e-6)
        >>> x, scale, shift = torch.randn(1, 16, 64), torch.randn(1, 64), torch.randn(1, 64)
        >>> torch.equal(layer_norm_affine(norm, x, scale, shift), layer_norm_affine_ref(norm, x, scale, shift))  # CPU
        True
    """
    return LAYER_NORM_AFFINE(site, norm, x, scale, shift)
