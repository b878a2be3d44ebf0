"""ERNIE-Image adapter: diffusers' ``ErnieImageTransformer2DModel``.

What `patch` changes, by ``__class__`` swap on the live modules (same parameters, same state dict) or through
diffusers' ``set_processor``:

- ``ErnieImageSharedAdaLNBlock``: its two adaLN chains run fused and bit-exact: ``adaLN_sa_ln`` + modulate as
  `rmsnorm_scale_shift`, and the attention branch's gated residual add + ``adaLN_mlp_ln`` + modulate as
  `gated_rmsnorm_scale_shift`, which also returns the residual stream. ``forward`` mirrors diffusers 0.42.1's
  (checked by source digest at patch time).
- ``ErnieImageSingleStreamAttnProcessor`` -> `FastpathErnieImageAttnProcessor`: diffusers computes
  ``torch.cos``/``torch.sin`` of the rotary angles (and casts them) for q and k in every attention call, 8 kernels a
  layer over the ``[B, S, 1, 128]`` float32 table (2.2 MB at 1024x1024), 288 a step; here they are computed once per
  angle table, i.e. once per forward, and shared by every layer (`RotaryTrig`, stored on the table tensor itself)
  where the forward is sealed: its layers called by diffusers' own forward, nothing below the model hooked, every
  processor known (`diffusers_fastpath.models._rope_cache`: a hook could write the table in place without a version
  bump, under ``inference_mode`` or through ``.data``); elsewhere each layer computes its own, as written. The angle
  table itself is diffusers' own, built once per forward by ``ErnieImageEmbedND3`` as unpatched.

Per step of the published model (36 layers) that is 72 fused norm sites and 36 attention processors.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_ernie_image import (
    ErnieImageAttention,
    ErnieImageSharedAdaLNBlock,
    ErnieImageSingleStreamAttnProcessor,
    ErnieImageTransformer2DModel,
)

from ..ops import gated_rmsnorm_scale_shift, rmsnorm_scale_shift
from .._state import PatchState, register_adapter
from . import _rope_cache
from ._mirror import mirrors

# sha256[:16] of the diffusers 0.42.1 sources that the mirrored methods below were copied from.
_BLOCK_FORWARD = "4e0e905bbd98a34d"
_PROCESSOR_CALL = "0d52a05eb8f8fa57"


class FastpathErnieImageSharedAdaLNBlock(ErnieImageSharedAdaLNBlock):
    """``ErnieImageSharedAdaLNBlock`` with both adaLN chains fused; mirrors diffusers 0.42.1's ``forward``."""

    def forward(self, x, rotary_pos_emb, temb, attention_mask=None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = temb
        residual = x
        x = rmsnorm_scale_shift(self.adaLN_sa_ln, x, scale_msa, shift_msa, self.adaLN_sa_ln._fastpath_site)
        x_bsh = x.permute(1, 0, 2)  # [S, B, H] → [B, S, H] for diffusers Attention (batch-first)
        attn_out = self.self_attention(x_bsh, attention_mask=attention_mask, image_rotary_emb=rotary_pos_emb)
        attn_out = attn_out.permute(1, 0, 2)  # [B, S, H] → [S, B, H]
        residual, x = gated_rmsnorm_scale_shift(
            self.adaLN_mlp_ln, residual, gate_msa, attn_out, scale_mlp, shift_mlp, self.adaLN_mlp_ln._fastpath_site,
            x.dtype,  # diffusers casts the gated product to the modulate output's dtype, not the residual's
        )
        return residual + (gate_mlp.float() * self.mlp(x).float()).to(x.dtype)


class RotaryTrig:
    """``torch.cos``/``torch.sin`` of one rotary angle table, cast to the attention dtype, shared by all layers of the
    forward that built the table where that forward is sealed (`_rope_cache.derived`); `stats` counts builds and
    reuses."""

    def __init__(self, stats: _rope_cache.CacheStats) -> None:
        self.stats = stats

    def get(self, freqs_cis: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _rope_cache.derived(
            freqs_cis, ("cos_sin", dtype), lambda: (torch.cos(freqs_cis).to(dtype), torch.sin(freqs_cis).to(dtype)),
            self.stats,
        )


class FastpathErnieImageAttnProcessor(ErnieImageSingleStreamAttnProcessor):
    """``ErnieImageSingleStreamAttnProcessor`` reading cos/sin from the shared `RotaryTrig`.

    ``__call__`` mirrors diffusers 0.42.1's (checked by source digest at patch time); only the two lines that
    computed ``torch.cos``/``torch.sin`` differ.
    """

    def __init__(self, trig: RotaryTrig) -> None:
        super().__init__()
        self.trig = trig

    def __call__(self, attn, hidden_states, attention_mask=None, freqs_cis=None):
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(-1, (attn.heads, -1))
        key = key.unflatten(-1, (attn.heads, -1))
        value = value.unflatten(-1, (attn.heads, -1))

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        def apply_rotary_emb(x_in: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
            rot_dim = freqs_cis.shape[-1]
            x, x_pass = x_in[..., :rot_dim], x_in[..., rot_dim:]
            cos_, sin_ = self.trig.get(freqs_cis, x.dtype)
            x1, x2 = x.chunk(2, dim=-1)
            x_rotated = torch.cat((-x2, x1), dim=-1)
            return torch.cat((x * cos_ + x_rotated * sin_, x_pass), dim=-1)

        if freqs_cis is not None:
            query = apply_rotary_emb(query, freqs_cis)
            key = apply_rotary_emb(key, freqs_cis)

        dtype = query.dtype
        query, key = query.to(dtype), key.to(dtype)

        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )

        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(dtype)
        output = attn.to_out[0](hidden_states)

        return output


@register_adapter(ErnieImageTransformer2DModel)
def patch_ernie_image(model: ErnieImageTransformer2DModel, state: PatchState) -> None:
    """Swap ERNIE-Image's blocks and attention processors (see module doc)."""
    swap_block = mirrors(ErnieImageSharedAdaLNBlock.forward, _BLOCK_FORWARD)
    for module in model.modules():
        kind = type(module)
        if kind is ErnieImageSharedAdaLNBlock and swap_block:
            state.swap_class(module, FastpathErnieImageSharedAdaLNBlock)
            state.add_site(module.adaLN_sa_ln, "rmsnorm_scale_shift")
            state.add_site(module.adaLN_mlp_ln, "gated_rmsnorm_scale_shift")
    if mirrors(ErnieImageSingleStreamAttnProcessor.__call__, _PROCESSOR_CALL):
        trig_stats = _rope_cache.CacheStats()
        state.set_attr(model, _rope_cache.STATS_PREFIX + "rotary_cos_sin", trig_stats)
        trig = RotaryTrig(trig_stats)
        state.replace_processors(
            model, ErnieImageAttention, ErnieImageSingleStreamAttnProcessor, lambda: FastpathErnieImageAttnProcessor(trig)
        )
