"""Fused ops, one file each: guard, eager reference, custom op with its fake, and the fallback wiring."""

from ._policy import OPS, FusedOp, Site
from .layernorm_scale_shift import (gated_layernorm_scale_shift, gated_layernorm_scale_shift_ref, layernorm_affine_fp32,
                                    layernorm_affine_fp32_ref, layernorm_scale_shift, layernorm_scale_shift_fp32,
                                    layernorm_scale_shift_fp32_ref, layernorm_scale_shift_ref)
from .layernorm_modulate import layernorm_modulate, layernorm_modulate_ref, layernorm_scale, layernorm_scale_ref
from .gated_residual import gated_residual, gated_residual_fp32, gated_residual_fp32_ref, gated_residual_ref
from .gated_layernorm_scale_rows import gated_layernorm_scale_rows, gated_layernorm_scale_rows_ref
from .cat_heads import cat_heads, cat_heads_ref
from .causal_conv_pad import causal_conv3d, causal_conv3d_ref
from .causal_conv_cl import causal_conv3d_cl
from .conv_bias import conv_bias, conv_bias_ref
from .conv_bias_residual import conv_bias_residual, conv_bias_residual_ref
from .channel_rmsnorm_silu import channel_rmsnorm, channel_rmsnorm_ref, channel_rmsnorm_silu, channel_rmsnorm_silu_ref
from .gelu_cat import gelu_cat, gelu_cat_ref
from .group_norm_silu import group_norm, group_norm_ref, group_norm_silu, group_norm_silu_ref
from .group_norm_silu_conv import group_norm_silu_conv, group_norm_silu_conv_ref
from .linear_cat import linear_cat, linear_cat_ref
from .linear_prefix import linear_prefix, linear_prefix_ref
from .linear_gelu import linear_gelu, linear_gelu_ref
from .ltx_bias_norm_conv import ltx_bias_norm_conv, ltx_bias_norm_conv_ref
from .ltx_causal_conv import ltx_causal_conv3d, ltx_causal_conv3d_ref
from .ltx_norm_conv import ltx_norm_conv, ltx_norm_conv_ref
from .ltx_upsampler import ltx_upsampler3d, ltx_upsampler3d_ref
from .ltx_vae_rmsnorm import ltx_rmsnorm, ltx_rmsnorm_ref, ltx_vae_rmsnorm_silu, ltx_vae_rmsnorm_silu_ref
from .ltx_vae_rmsnorm_conv import ltx_vae_rmsnorm_conv, ltx_vae_rmsnorm_conv_ref
from .modulate_scale_shift import modulate_scale_shift, modulate_scale_shift_ref
from .per_channel_rmsnorm import (per_channel_rmsnorm, per_channel_rmsnorm_ref, per_channel_rmsnorm_silu,
                                  per_channel_rmsnorm_silu_ref)
from .qk_norm_rope import (qk_norm_rope, qk_norm_rope_ref, qk_norm_rows_rope, qk_norm_rows_rope_pair,
                           qk_norm_rows_rope_pair_ref, qk_norm_rows_rope_ref)
from .qk_norm_rope_fp32 import (qk_norm_rope_fp32, qk_norm_rope_fp32_ref, qk_norm_rope_zero_centred,
                                qk_norm_rope_zero_centred_ref)
from .rms_norm_modulate_rows import rms_norm_modulate_rows, rms_norm_modulate_rows_ref
from .rmsnorm import rmsnorm, rmsnorm_ref
from .rmsnorm_modulate import rmsnorm_modulate, rmsnorm_modulate_ref
from .rmsnorm_scale_shift import (
    gated_rmsnorm_scale_shift,
    gated_rmsnorm_scale_shift_ref,
    rmsnorm_gated_residual,
    rmsnorm_gated_residual_ref,
    rmsnorm_scale,
    rmsnorm_scale_ref,
    rmsnorm_scale_shift,
    rmsnorm_scale_shift_ref,
)
from .rmsnorm_rope import (rmsnorm_rope_complex, rmsnorm_rope_complex_cat, rmsnorm_rope_complex_cat_ref,
                           rmsnorm_rope_complex_ref, rmsnorm_rope_real, rmsnorm_rope_real_ref)
from .rmsnorm_rope_prefix import rmsnorm_rope_complex_prefix, rmsnorm_rope_complex_prefix_ref
from .rotary_half import rotary_half, rotary_half_partial, rotary_half_partial_ref, rotary_half_ref
from .qk_norm_rotary_half import qk_norm_rotary_half, qk_norm_rotary_half_ref
from .rotary_matrix import rotary_matrix, rotary_matrix_ref
from .rotary import (rotary_emb, rotary_emb_ref, rotary_emb_rows, rotary_emb_rows_ref, rotary_emb_wan,
                     rotary_emb_wan_ref)
from .sigmoid_mul import sigmoid_mul, sigmoid_mul_ref
from .silu_mul import silu_mul, silu_mul_ref, swiglu_cat, swiglu_cat_ref
from .upsample_nearest import upsample_nearest2x, upsample_nearest2x_ref
from .zero_centred_modulate import zero_centred_modulate, zero_centred_modulate_ref
from .zero_centred_rmsnorm import zero_centred_rmsnorm, zero_centred_rmsnorm_ref

__all__ = [
    "OPS",
    "FusedOp",
    "Site",
    "cat_heads",
    "cat_heads_ref",
    "causal_conv3d",
    "causal_conv3d_cl",
    "causal_conv3d_ref",
    "conv_bias",
    "conv_bias_ref",
    "conv_bias_residual",
    "conv_bias_residual_ref",
    "channel_rmsnorm",
    "channel_rmsnorm_ref",
    "channel_rmsnorm_silu",
    "channel_rmsnorm_silu_ref",
    "gated_layernorm_scale_shift",
    "gated_layernorm_scale_shift_ref",
    "gated_layernorm_scale_rows",
    "gated_layernorm_scale_rows_ref",
    "gated_residual",
    "gated_residual_fp32",
    "gated_residual_fp32_ref",
    "gated_residual_ref",
    "gated_rmsnorm_scale_shift",
    "gelu_cat",
    "gelu_cat_ref",
    "group_norm",
    "group_norm_ref",
    "group_norm_silu",
    "group_norm_silu_ref",
    "group_norm_silu_conv",
    "group_norm_silu_conv_ref",
    "gated_rmsnorm_scale_shift_ref",
    "layernorm_affine_fp32",
    "layernorm_modulate",
    "layernorm_modulate_ref",
    "layernorm_scale",
    "layernorm_scale_ref",
    "layernorm_affine_fp32_ref",
    "layernorm_scale_shift",
    "layernorm_scale_shift_fp32",
    "layernorm_scale_shift_fp32_ref",
    "layernorm_scale_shift_ref",
    "linear_cat",
    "linear_cat_ref",
    "linear_prefix",
    "linear_prefix_ref",
    "linear_gelu",
    "linear_gelu_ref",
    "ltx_bias_norm_conv",
    "ltx_bias_norm_conv_ref",
    "ltx_causal_conv3d",
    "ltx_causal_conv3d_ref",
    "ltx_norm_conv",
    "ltx_norm_conv_ref",
    "ltx_upsampler3d",
    "ltx_upsampler3d_ref",
    "ltx_rmsnorm",
    "ltx_rmsnorm_ref",
    "ltx_vae_rmsnorm_conv",
    "ltx_vae_rmsnorm_conv_ref",
    "ltx_vae_rmsnorm_silu",
    "ltx_vae_rmsnorm_silu_ref",
    "modulate_scale_shift",
    "modulate_scale_shift_ref",
    "per_channel_rmsnorm",
    "per_channel_rmsnorm_ref",
    "per_channel_rmsnorm_silu",
    "per_channel_rmsnorm_silu_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "qk_norm_rows_rope",
    "qk_norm_rows_rope_pair",
    "qk_norm_rows_rope_pair_ref",
    "qk_norm_rows_rope_ref",
    "qk_norm_rope_fp32",
    "qk_norm_rope_fp32_ref",
    "qk_norm_rope_zero_centred",
    "qk_norm_rope_zero_centred_ref",
    "qk_norm_rotary_half",
    "qk_norm_rotary_half_ref",
    "rms_norm_modulate_rows",
    "rms_norm_modulate_rows_ref",
    "rmsnorm",
    "rmsnorm_gated_residual",
    "rmsnorm_modulate",
    "rmsnorm_modulate_ref",
    "rmsnorm_ref",
    "rmsnorm_rope_complex",
    "rmsnorm_rope_complex_cat",
    "rmsnorm_rope_complex_cat_ref",
    "rmsnorm_rope_complex_prefix",
    "rmsnorm_rope_complex_prefix_ref",
    "rmsnorm_rope_complex_ref",
    "rmsnorm_rope_real",
    "rmsnorm_rope_real_ref",
    "rmsnorm_gated_residual_ref",
    "rmsnorm_scale",
    "rmsnorm_scale_ref",
    "rmsnorm_scale_shift",
    "rmsnorm_scale_shift_ref",
    "rotary_half",
    "rotary_half_partial",
    "rotary_half_partial_ref",
    "rotary_half_ref",
    "rotary_matrix",
    "rotary_matrix_ref",
    "rotary_emb",
    "rotary_emb_rows",
    "rotary_emb_rows_ref",
    "rotary_emb_wan",
    "rotary_emb_wan_ref",
    "sigmoid_mul",
    "sigmoid_mul_ref",
    "silu_mul",
    "silu_mul_ref",
    "swiglu_cat",
    "swiglu_cat_ref",
    "upsample_nearest2x",
    "upsample_nearest2x_ref",
    "rotary_emb_ref",
    "zero_centred_modulate",
    "zero_centred_modulate_ref",
    "zero_centred_rmsnorm",
    "zero_centred_rmsnorm_ref",
]
