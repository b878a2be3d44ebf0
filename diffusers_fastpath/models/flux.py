"""FLUX.1 adapter: diffusers' ``FluxTransformer2DModel`` (FLUX.1 dev, schnell, Kontext, Fill).

What `patch` changes, all by ``__class__`` swap on the live modules (same parameters, same state dict) or through
diffusers' own extension points:

- ``AdaLayerNormZero`` (``norm1``, ``norm1_context``) and ``AdaLayerNormZeroSingle`` (``norm``):
  the modulate ``norm(x) * (1 + scale) + shift`` runs as the fused `modulate_scale_shift` op.
- ``FluxTransformerBlock``: the ``norm2``/``norm2_context`` modulates run through the same op (the block's
  ``forward`` mirrors diffusers 0.42.1's, checked by source digest at patch time).
- ``FluxPosEmbed``: the rotary cos/sin is built once per set of position ids and reused across denoising steps
  (keyed on the identity and version counter of ``txt_ids``/``img_ids``: no host sync), as a `FluxRotaryCache`.
- ``FluxAttention``: diffusers' ``FluxAttnProcessor`` is replaced by `FastpathFluxAttnProcessor` via
  ``set_processor``; any other processor (IP-adapter, a user's own) is left in place and noted in `report`. The
  processor runs the QK RMSNorm, the text/image concatenation and the rotary embedding of q and of k as one fused
  `qk_norm_rope` each (self-verified; where it cannot run, the norms run eagerly and the rotary embedding as the
  exact fused `rotary_emb`). Each such module carries two sites, ``[qk_norm_rope]`` and ``[rotary_emb]``.

Per FLUX.1-dev step (19 dual + 38 single blocks) that is 114 fused modulate sites, 57 attention processors with
114 fused QK norm + rotary calls, and one rotary cache.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxPosEmbed,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
    _get_qkv_projections,
)

from ..ops import modulate_scale_shift, qk_norm_rope
from ..patching import PatchState, register_adapter, site_attr
from . import _rope_cache
from ._mirror import mirrors

MODULATE = "modulate_scale_shift"
QK_NORM_ROPE = "qk_norm_rope"  # an attention module's fused QK norm + concatenation + rotary embedding
ROTARY = "rotary_emb"  # the fused rotary embedding it falls back to where the norm cannot be fused
_QK_NORM_ROPE_ATTR = site_attr(QK_NORM_ROPE)
_ROTARY_ATTR = site_attr(ROTARY)

# sha256[:16] of the diffusers sources that the mirrored methods below were copied from (diffusers 0.42.1).
_ADALN_ZERO_FORWARD = "93374820c014f812"
_ADALN_ZERO_SINGLE_FORWARD = "d48dfb2b1e75e64f"
_BLOCK_FORWARD = "0b184cbe172708b6"
_SINGLE_BLOCK_FORWARD = "57350a6dab842b40"
_PROCESSOR_CALL = "d5b36134887ebe45"


def _norm_modulate(norm: torch.nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, site) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]``: the LayerNorm + modulate of every FLUX adaLN site
    (``site`` counts its calls)."""
    return modulate_scale_shift(norm(x), scale, shift, site)


class FastpathAdaLayerNormZero(AdaLayerNormZero):
    """``AdaLayerNormZero`` whose modulate is the fused, bit-exact `modulate_scale_shift`. Adds no state."""

    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = _norm_modulate(self.norm, x, scale_msa, shift_msa, self._fastpath_site)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class FastpathAdaLayerNormZeroSingle(AdaLayerNormZeroSingle):
    """``AdaLayerNormZeroSingle`` whose modulate is the fused, bit-exact `modulate_scale_shift`. Adds no state."""

    def forward(self, x, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        x = _norm_modulate(self.norm, x, scale_msa, shift_msa, self._fastpath_site)
        return x, gate_msa


class FastpathFluxTransformerBlock(FluxTransformerBlock):
    """``FluxTransformerBlock`` with its ``norm2``/``norm2_context`` modulates fused.

    ``forward`` mirrors diffusers 0.42.1's line for line; only the two modulate lines differ.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)

        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb
        )
        joint_attention_kwargs = joint_attention_kwargs or {}

        attention_outputs = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            image_rotary_emb=image_rotary_emb,
            **joint_attention_kwargs,
        )

        if len(attention_outputs) == 2:
            attn_output, context_attn_output = attention_outputs
        elif len(attention_outputs) == 3:
            attn_output, context_attn_output, ip_attn_output = attention_outputs

        attn_output = gate_msa.unsqueeze(1) * attn_output
        hidden_states = hidden_states + attn_output

        norm_hidden_states = _norm_modulate(self.norm2, hidden_states, scale_mlp, shift_mlp, self.norm2._fastpath_site)

        ff_output = self.ff(norm_hidden_states)
        ff_output = gate_mlp.unsqueeze(1) * ff_output

        hidden_states = hidden_states + ff_output
        if len(attention_outputs) == 3:
            hidden_states = hidden_states + ip_attn_output

        context_attn_output = c_gate_msa.unsqueeze(1) * context_attn_output
        encoder_hidden_states = encoder_hidden_states + context_attn_output

        norm_encoder_hidden_states = _norm_modulate(
            self.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp, self.norm2_context._fastpath_site
        )

        context_ff_output = self.ff_context(norm_encoder_hidden_states)
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)

        return encoder_hidden_states, hidden_states


class FastpathFluxSingleTransformerBlock(FluxSingleTransformerBlock):
    """``FluxSingleTransformerBlock`` whose elementwise chains run through the fused ops.

    ``forward`` mirrors diffusers 0.42.1's line for line (checked by source digest at patch time).
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
        joint_attention_kwargs = joint_attention_kwargs or {}
        attn_output = self.attn(
            hidden_states=norm_hidden_states,
            image_rotary_emb=image_rotary_emb,
            **joint_attention_kwargs,
        )

        hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
        gate = gate.unsqueeze(1)
        hidden_states = gate * self.proj_out(hidden_states)
        hidden_states = residual + hidden_states
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)

        encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
        return encoder_hidden_states, hidden_states


class FluxRotaryCache(tuple):
    """``(freqs_cos, freqs_sin)`` exactly as ``FluxPosEmbed`` returns them, built once per set of position ids.

    A plain tuple, so every processor that unpacks ``cos, sin = image_rotary_emb`` (IP-adapter, a user's own)
    keeps working; `FastpathFluxAttnProcessor` hands the fp32 ``[S, D]`` tables to the fused rotary kernels as they
    are.
    """

    def __new__(cls, cos: torch.Tensor, sin: torch.Tensor) -> "FluxRotaryCache":
        return super().__new__(cls, (cos, sin))


class FastpathFluxPosEmbed(FluxPosEmbed):
    """``FluxPosEmbed`` that returns a cached `FluxRotaryCache` while the transformer's position ids are unchanged.

    The transformer concatenates ``txt_ids`` and ``img_ids`` into a new tensor every forward, so the key is taken
    from the forward's own arguments (`_ids_key`); a call outside a patched forward computes as diffusers does.
    """

    def forward(self, ids: torch.Tensor):
        return _rope_cache.cached(self, lambda: FluxRotaryCache(*super(FastpathFluxPosEmbed, self).forward(ids)))


def _ids_key(args: tuple, kwargs: dict) -> _rope_cache.ForwardKey | None:
    # forward(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, ...)
    img_ids = _rope_cache.argument(args, kwargs, "img_ids", 4)
    txt_ids = _rope_cache.argument(args, kwargs, "txt_ids", 5)
    if isinstance(txt_ids, torch.Tensor) and isinstance(img_ids, torch.Tensor):
        return _rope_cache.ForwardKey((txt_ids, img_ids))
    return None


class FastpathFluxAttnProcessor(FluxAttnProcessor):
    """``FluxAttnProcessor`` whose QK RMSNorm, text/image concatenation of q and k, and rotary embedding run as one
    fused op per tensor (`qk_norm_rope`; where the norm cannot be fused, its fallback keeps the exact fused
    `rotary_emb`). Counts its calls on the attention module's two sites (``[qk_norm_rope]``, ``[rotary_emb]`` in
    `report`); a module without them (not patched by `patch`) runs the same code uncounted.

    ``__call__`` mirrors diffusers 0.42.1's (checked by source digest at patch time); the q/k norm, cat and rotary
    lines are replaced by the fused op, the rest is unchanged (``value`` is still concatenated by ``torch.cat``).
    """

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )

        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))

        joint = attn.added_kv_proj_dim is not None
        if joint:
            encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
            encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            value = torch.cat([encoder_value, value], dim=1)

        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            site = attn.__dict__.get(_QK_NORM_ROPE_ATTR)
            rope_site = attn.__dict__.get(_ROTARY_ATTR)
            if joint:
                query = qk_norm_rope(attn.norm_added_q, encoder_query, attn.norm_q, query, cos, sin, site, rope_site)
                key = qk_norm_rope(attn.norm_added_k, encoder_key, attn.norm_k, key, cos, sin, site, rope_site)
            else:
                query = qk_norm_rope(None, None, attn.norm_q, query, cos, sin, site, rope_site)
                key = qk_norm_rope(None, None, attn.norm_k, key, cos, sin, site, rope_site)
        else:  # diffusers' lines: nothing to fuse the norms with
            query = attn.norm_q(query)
            key = attn.norm_k(key)
            if joint:
                encoder_query = attn.norm_added_q(encoder_query)
                encoder_key = attn.norm_added_k(encoder_key)
                query = torch.cat([encoder_query, query], dim=1)
                key = torch.cat([encoder_key, key], dim=1)

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
            )
            hidden_states = attn.to_out[0](hidden_states.contiguous())
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())

            return hidden_states, encoder_hidden_states
        else:
            return hidden_states


@register_adapter(FluxTransformer2DModel)
def patch_flux(model: FluxTransformer2DModel, state: PatchState) -> None:
    """Swap FLUX.1's adaLN modules, dual blocks, rotary embedding and attention processors (see module doc)."""
    swap_adaln = mirrors(AdaLayerNormZero.forward, _ADALN_ZERO_FORWARD)
    swap_adaln_single = mirrors(AdaLayerNormZeroSingle.forward, _ADALN_ZERO_SINGLE_FORWARD)
    swap_block = mirrors(FluxTransformerBlock.forward, _BLOCK_FORWARD)
    swap_single_block = mirrors(FluxSingleTransformerBlock.forward, _SINGLE_BLOCK_FORWARD)

    for module in model.modules():
        kind = type(module)
        if kind is AdaLayerNormZero and swap_adaln:
            state.swap_class(module, FastpathAdaLayerNormZero)
            state.add_site(module, MODULATE)
        elif kind is AdaLayerNormZeroSingle and swap_adaln_single:
            state.swap_class(module, FastpathAdaLayerNormZeroSingle)
            state.add_site(module, MODULATE)
        elif kind is FluxTransformerBlock and swap_block:
            state.swap_class(module, FastpathFluxTransformerBlock)
            state.add_site(module.norm2, MODULATE)
            state.add_site(module.norm2_context, MODULATE)
        elif kind is FluxSingleTransformerBlock and swap_single_block:
            state.swap_class(module, FastpathFluxSingleTransformerBlock)
        elif kind is FluxPosEmbed:
            _rope_cache.install(state, model, module, FastpathFluxPosEmbed, _ids_key)
    if mirrors(FluxAttnProcessor.__call__, _PROCESSOR_CALL):
        state.replace_processors(model, FluxAttention, FluxAttnProcessor, FastpathFluxAttnProcessor)
        for module in model.modules():
            if isinstance(module, FluxAttention) and type(module.processor) is FastpathFluxAttnProcessor:
                state.add_site(module, QK_NORM_ROPE, name=QK_NORM_ROPE)
                state.add_site(module, ROTARY, name=ROTARY)
