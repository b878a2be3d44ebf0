"""Fused ops, one file each: guard, eager reference, custom op with its fake, and the fallback wiring."""

from ._policy import OPS, FusedOp, Site
from .modulate_scale_shift import modulate_scale_shift, modulate_scale_shift_ref
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from .rmsnorm_scale_shift import (
    gated_rmsnorm_scale_shift,
    gated_rmsnorm_scale_shift_ref,
    rmsnorm_scale_shift,
    rmsnorm_scale_shift_ref,
)
from .rotary import rotary_emb, rotary_emb_ref

__all__ = [
    "OPS",
    "FusedOp",
    "Site",
    "gated_rmsnorm_scale_shift",
    "gated_rmsnorm_scale_shift_ref",
    "modulate_scale_shift",
    "modulate_scale_shift_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "rmsnorm_scale_shift",
    "rmsnorm_scale_shift_ref",
    "rotary_emb",
    "rotary_emb_ref",
]
