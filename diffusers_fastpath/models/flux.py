"""FLUX.1 adapter: diffusers' ``FluxTransformer2DModel`` (FLUX.1 dev, schnell, Kontext, Fill).

What `patch` changes, all by ``__class__`` swap on the live modules (same parameters, same state dict) or through
diffusers' own extension points:

- ``AdaLayerNormZero`` (``norm1``, ``norm1_context``) and ``AdaLayerNormZeroSingle`` (``norm``):
  the LayerNorm and modulate ``norm(x) * (1 + scale) + shift`` run as the fused `layernorm_scale_shift` op.
- ``FluxTransformerBlock``: the ``norm2``/``norm2_context`` modulates run through the same op, and the four gated
  residual adds (``hidden_states + gate_msa.unsqueeze(1) * attn_output`` and its siblings for ``gate_mlp``,
  ``c_gate_msa``, ``c_gate_mlp``) through the fused `gated_residual` (the block's ``forward`` mirrors diffusers
  0.42.1's, checked by source digest at patch time).
- ``FluxSingleTransformerBlock``: ``residual + gate * proj_out(...)`` runs as `gated_residual`; the leading
  ``cat([encoder_hidden_states, hidden_states], dim=1)`` becomes the tensor both halves are views of when they are
  (every single block after the first: no copy; values are moved, never changed). The ``act_mlp`` GELU and the
  ``cat([attn_output, mlp_hidden_states], dim=2)`` run as one `gelu_cat` (the GELU proven exact on every value of
  the dtype): the MLP activations are read and written once instead of twice.
- ``FluxPosEmbed``: `_pos_embed.FastpathFluxPosEmbed`, the same fp32 ``[S, D]`` cos/sin tables built once per forward
  (as diffusers does; no cache across forwards: see `diffusers_fastpath.models._rope_cache` for why) in 6 kernels
  instead of 41, the host's work at the start of every step; the fused rotary kernels read them as they are.
- ``FluxAttention``: diffusers' ``FluxAttnProcessor`` is replaced by `FastpathFluxAttnProcessor` via
  ``set_processor``; any other processor (IP-adapter, a user's own) is left in place and noted in `report`. The
  processor runs the QK RMSNorm, the text/image concatenation and the rotary embedding of q and of k as one fused
  `qk_norm_rope` each (self-verified; where it cannot run, the norms run eagerly and the rotary embedding as the
  exact fused `rotary_emb`). Each such module carries two sites, ``qk_norm_rope`` and ``rotary_emb``; a dual
  block's (joint) module a third, ``value_cat``, where its value projections are plain ``nn.Linear`` layers: the text
  and image value projections write their rows of the joint value tensor (`linear_cat`: at batch 1 each GEMM's output
  is a contiguous row range of it) instead of being concatenated by ``torch.cat`` afterwards.
- ``GELU`` (the dual blocks' ``ff.net.0``/``ff_context.net.0``): `FastpathGELU`, the lossless forward until the
  ``"high"`` tier mounts its site.
- Each stream's closing gated residual update and the LayerNorm-modulate that reads the new stream next run as one
  `gated_layernorm_scale_shift` (`_handoff`): in the dual block the attention's update with ``norm2``
  (``norm2_context``); at the end of a block, its last update with the next block's adaLN, which the block hands its
  modulation and normed stream (each such norm or adaLN has a ``gated`` site; refusals are counted there).

Per FLUX.1-dev step (19 dual + 38 single blocks) that is 114 fused LayerNorm+modulate sites, 114 gated residual
sites, 37 token-concatenation sites, 38 GELU + concatenation sites, 57 attention processors with 114 fused QK
norm + rotary calls, 19 value-concatenation sites, 111 fused update + LayerNorm-modulate sites (38 ``norm2`` and
``norm2_context``, 36 dual and 37 single blocks' adaLNs after the first); and for the ``"high"`` tier
(`diffusers_fastpath.quality`) 114 LayerNorm-affine-folding sites (the adaLN LayerNorms) and 76 GELU-epilogue sites
(the FFN up-projections: 2 per dual block, 1 per single block).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from diffusers.models.activations import GELU
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
    _get_projections,
    _get_qkv_projections,
)

from ..ops import gelu_cat, linear_cat, linear_gelu, qk_norm_rope
from .._state import PatchState, register_adapter, site_attr
from ..quality import LINEAR_GELU, hooked, linear_gelu_unfit, mark_site, plain_linear_unfit
from ._chain_calls import gelu_cat_unfit, norm_modulate
from ._handoff import add_receiver, gated_norm_modulate, hand_off, link, receivers_of, take_hand_off
from ._mirror import mirrors
from ._pos_embed import patch_pos_embed

MODULATE = "layernorm_scale_shift"  # the op of every adaLN site: LayerNorm and modulate in one kernel
GATED_RESIDUAL = "gated_residual"
JOINT_TOKENS_VIEW = "joint_tokens_view"  # cat([text, image], dim=1) of two adjacent views: their base, no copy
GELU_CAT = "gelu_cat"  # a single block's act_mlp GELU and cat([attn_output, mlp], dim=2) in one kernel

# The sites of a dual block, named after diffusers' gate variables, and of a single block.
_BLOCK_GATES = ("gate_msa", "gate_mlp", "c_gate_msa", "c_gate_mlp")
QK_NORM_ROPE = "qk_norm_rope"  # an attention module's fused QK norm + concatenation + rotary embedding
ROTARY = "rotary_emb"  # the fused rotary embedding it falls back to where the norm cannot be fused
_QK_NORM_ROPE_ATTR = site_attr(QK_NORM_ROPE)
_ROTARY_ATTR = site_attr(ROTARY)
VALUE_CAT = "linear_cat"  # a dual block's value projections written into their joint tensor
_VALUE_CAT_ATTR = site_attr("value_cat")
REASON_IP_ADAPTER = "IP-Adapter output added after the update"

# sha256[:16] of the diffusers sources that the mirrored methods below were copied from (diffusers 0.42.1).
_ADALN_ZERO_FORWARD = "93374820c014f812"
_ADALN_ZERO_SINGLE_FORWARD = "d48dfb2b1e75e64f"
_BLOCK_FORWARD = "0b184cbe172708b6"
_SINGLE_BLOCK_FORWARD = "57350a6dab842b40"
_PROCESSOR_CALL = "d5b36134887ebe45"
_GET_PROJECTIONS = "49221168b024c3c8"


def _joint_tokens(encoder_hidden_states: torch.Tensor, hidden_states: torch.Tensor, site) -> torch.Tensor:
    """``torch.cat([encoder_hidden_states, hidden_states], dim=1)``, without the copy when it is not needed.

    Between single blocks the two streams are ``out[:, :T]`` and ``out[:, T:]`` of the previous block's output
    ``out``: their concatenation is ``out`` itself, element for element, so that is returned (exact by
    construction). The single block only reads it (LayerNorm, the residual add, both out of place), and every
    later write in diffusers' ``FluxTransformer2DModel.forward`` (the ControlNet residuals) is out of place too.
    Anything else (autograd, which needs the ``cat`` node; inputs that are not two such halves) concatenates as
    diffusers does, counted with the reason. The first single block, whose inputs are always the dual blocks' two
    separate tensors, has no site (``site`` is ``None``) and concatenates.
    """
    if site is None or torch.compiler.is_compiling():  # no storage to inspect while tracing: the compiler plans it
        return torch.cat([encoder_hidden_states, hidden_states], dim=1)
    base = hidden_states._base
    if base is None or encoder_hidden_states._base is not base:
        reason = "text and image are separate tensors"
    elif torch.is_grad_enabled() and base.requires_grad:
        reason = "requires grad"
    else:
        text = encoder_hidden_states.shape[1]
        strides = base.stride()
        if (
            base.dim() == 3
            and encoder_hidden_states.shape == (base.shape[0], text, base.shape[2])
            and hidden_states.shape == (base.shape[0], base.shape[1] - text, base.shape[2])
            and encoder_hidden_states.stride() == strides
            and hidden_states.stride() == strides
            and encoder_hidden_states.storage_offset() == base.storage_offset()
            and hidden_states.storage_offset() == base.storage_offset() + text * strides[1]
            and base.is_contiguous()
        ):
            site.fast += 1
            return base
        reason = "not the two halves of one tensor"
    site.fallback[reason] += 1
    return torch.cat([encoder_hidden_states, hidden_states], dim=1)


def _epilogue_mounted(tier, linear: torch.nn.Module, act: torch.nn.Module | None = None) -> bool:
    """Whether an FFN up-projection's tanh-GELU runs as its GEMM's epilogue: the tier site is mounted
    (quality="high"), `linear` is still a plain ``nn.Linear`` (a LoRA layer swapped in since mounting: lossless) and
    neither it nor the activation `act` the GEMM stands for has hooks now (one registered since mounting, a global
    one: they run on the two eager calls)."""
    return (tier.mounted and type(linear) is torch.nn.Linear and not hooked(linear)
            and (act is None or not hooked(act)))


def _up_proj_gelu(linear: torch.nn.Linear, act: torch.nn.Module, x: torch.Tensor, tier) -> torch.Tensor:
    """``act(linear(x))``, a FLUX FFN up-projection and its tanh-GELU: one cuBLASLt call with the GELU epilogue
    where the tier site is mounted (quality="high"), else the two eager modules."""
    if _epilogue_mounted(tier, linear, act):
        return linear_gelu(x, linear.weight, linear.bias, tier.counters)
    return act(linear(x))


def _gelu_in_cat(block: FluxSingleTransformerBlock) -> bool:
    """Whether the single block's ``act_mlp`` runs inside `gelu_cat`: it has the site, its ``act_mlp`` is still a
    plain tanh ``nn.GELU`` without hooks (checked per call: skipping it must skip nothing else), and the ``"high"``
    tier has not fused the GELU into the up-projection."""
    site = block._fastpath_site_gelu_cat
    if site is None or _epilogue_mounted(block._fastpath_tier, block.proj_mlp, block.act_mlp):
        return False
    reason = gelu_cat_unfit(block.act_mlp)
    if reason is not None:
        site.fallback[reason] += 1
    return reason is None


class FastpathGELU(GELU):
    """diffusers' ``GELU`` (``proj`` + GELU) of a FLUX FFN, the up-projection and tanh-GELU fused into one GEMM while
    its tier site is mounted (quality="high"); otherwise diffusers' own forward. Adds no state."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tier = self._fastpath_tier
        if _epilogue_mounted(tier, self.proj):
            return linear_gelu(hidden_states, self.proj.weight, self.proj.bias, tier.counters)
        return super().forward(hidden_states)


def _adaln_norm(adaln, x, emb):
    """An adaLN's ``(modulation chunks, modulated norm of x)``: what the previous block handed it (`_handoff`), or
    ``linear(silu(emb))`` and the fused `layernorm_scale_shift`, as written. Called by the adaLN's forward."""
    # a torch.compile trace hands nothing off (`hand_off`), nor reads frames
    handed, normed = (None, None) if torch.compiler.is_compiling() else take_hand_off(adaln, x, emb, sys._getframe(1))
    chunks = (adaln.linear(adaln.silu(emb)) if handed is None else handed).chunk(adaln._fastpath_chunks, dim=1)
    if normed is None:
        normed = norm_modulate(adaln.norm, x, chunks[1], chunks[0], adaln._fastpath_site)
    else:
        adaln._fastpath_site.fast += 1  # computed fused, at the end of the previous block
    return chunks, normed


class FastpathAdaLayerNormZero(AdaLayerNormZero):
    """``AdaLayerNormZero`` whose LayerNorm + modulate is the fused, bit-exact `layernorm_scale_shift`, or was
    computed by the previous block, fused with its closing update (`_handoff`). Adds no state."""

    _fastpath_chunks = 6

    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        (_, _, gate_msa, shift_mlp, scale_mlp, gate_mlp), x = _adaln_norm(self, x, emb)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class FastpathAdaLayerNormZeroSingle(AdaLayerNormZeroSingle):
    """``AdaLayerNormZeroSingle`` whose LayerNorm + modulate is the fused, bit-exact `layernorm_scale_shift`, or was
    computed by the previous block, fused with its closing update (`_handoff`). Adds no state."""

    _fastpath_chunks = 3

    def forward(self, x, emb=None):
        (_, _, gate_msa), x = _adaln_norm(self, x, emb)
        return x, gate_msa


class FastpathFluxTransformerBlock(FluxTransformerBlock):
    """``FluxTransformerBlock`` with its ``norm2``/``norm2_context`` modulates and its four gated residual adds fused.

    ``forward`` mirrors diffusers 0.42.1's line for line; only the two modulate lines and the four residual updates
    differ (each ``gate.unsqueeze(1) * update`` then ``residual + that`` pair is one `gated_residual` call).
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

        hidden_states, norm_hidden_states = gated_norm_modulate(
            self.norm2, hidden_states, gate_msa.unsqueeze(1), attn_output, scale_mlp, shift_mlp,
            self._fastpath_site_gate_msa, self.norm2._fastpath_site
        )

        image_next, text_next = receivers_of(self) or (None, None)
        ff_output = self.ff(norm_hidden_states)
        hidden_states = hand_off(
            self, image_next, hidden_states, gate_mlp.unsqueeze(1), ff_output, temb, self._fastpath_site_gate_mlp,
            refused=REASON_IP_ADAPTER if len(attention_outputs) == 3 else None,
            between=(self.norm2_context, self.ff_context),
        )
        if len(attention_outputs) == 3:
            hidden_states = hidden_states + ip_attn_output

        encoder_hidden_states, norm_encoder_hidden_states = gated_norm_modulate(
            self.norm2_context, encoder_hidden_states, c_gate_msa.unsqueeze(1), context_attn_output, c_scale_mlp,
            c_shift_mlp, self._fastpath_site_c_gate_msa, self.norm2_context._fastpath_site
        )

        context_ff_output = self.ff_context(norm_encoder_hidden_states)
        encoder_hidden_states = hand_off(
            self, text_next, encoder_hidden_states, c_gate_mlp.unsqueeze(1), context_ff_output, temb,
            self._fastpath_site_c_gate_mlp, clipped=True,
        )
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)

        return encoder_hidden_states, hidden_states


class FastpathFluxSingleTransformerBlock(FluxSingleTransformerBlock):
    """``FluxSingleTransformerBlock`` whose gated residual add is fused and whose token concatenation copies nothing.

    ``forward`` mirrors diffusers 0.42.1's line for line (checked by source digest at patch time); the leading
    ``cat`` goes through `_joint_tokens`; the MLP's GELU runs inside the fused `gelu_cat` of the attention and MLP
    outputs (`_gelu_in_cat`), or, where the ``"high"`` tier has mounted the block's ``linear_gelu`` site, as the
    up-projection's epilogue (`_up_proj_gelu`); the residual update goes through `gated_residual`.
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
        hidden_states = _joint_tokens(encoder_hidden_states, hidden_states, self._fastpath_site_cat_tokens)

        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        gelu_in_cat = _gelu_in_cat(self)  # the GELU runs inside the concatenation below
        if gelu_in_cat:
            mlp_hidden_states = self.proj_mlp(norm_hidden_states)
        else:
            mlp_hidden_states = _up_proj_gelu(self.proj_mlp, self.act_mlp, norm_hidden_states, self._fastpath_tier)
        joint_attention_kwargs = joint_attention_kwargs or {}
        attn_output = self.attn(
            hidden_states=norm_hidden_states,
            image_rotary_emb=image_rotary_emb,
            **joint_attention_kwargs,
        )

        if gelu_in_cat:
            hidden_states = gelu_cat(attn_output, mlp_hidden_states, self._fastpath_site_gelu_cat)
        else:
            hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
        gate = gate.unsqueeze(1)
        (next_norm,) = receivers_of(self) or (None,)
        hidden_states = hand_off(
            self, next_norm, residual, gate, self.proj_out(hidden_states), temb, self._fastpath_site_gate, clipped=True
        )
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)

        encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
        return encoder_hidden_states, hidden_states


def _value_projections_unfit(attn: FluxAttention) -> str | None:
    """Why the joint attention module's ``add_v_proj`` and ``to_v`` cannot be read as weights (their forwards must
    run), or ``None``."""
    if attn.fused_projections:
        return "fused projections (to_qkv)"
    for linear in (attn.add_v_proj, attn.to_v):
        reason = plain_linear_unfit(linear)
        if reason is not None:
            return reason
        if type(linear.bias) not in (torch.nn.Parameter, torch.Tensor):
            return "bias is not a plain tensor (quantized)"
        if hooked(linear):
            return "a value projection has hooks"
    return None


def _records_grad(attn: FluxAttention, *inputs: torch.Tensor) -> bool:
    projections = (attn.to_q, attn.to_k, attn.to_v, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
    return any(t.requires_grad for t in inputs) or any(p.requires_grad for m in projections for p in m.parameters())


def _joint_value_projections(attn: FluxAttention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor):
    """diffusers' ``_get_projections`` for a joint attention module, its two value projections written straight into
    their concatenation (`linear_cat`): ``(query, key, encoder_query, encoder_key, value)`` with ``value`` the
    ``[B, T + S, N]`` joint values; ``None`` (counted with the reason) where the module's projections must run as
    written, and the caller runs diffusers' own."""
    site = attn.__dict__.get(_VALUE_CAT_ATTR)
    if site is None or encoder_hidden_states is None:
        return None
    reason = _value_projections_unfit(attn)
    if reason is None and torch.is_grad_enabled() and _records_grad(attn, hidden_states, encoder_hidden_states):
        reason = "requires grad"  # diffusers' order of the six projections is the order their gradients sum in
    if reason is not None:
        site.fallback[reason] += 1
        return None
    query = attn.to_q(hidden_states)
    key = attn.to_k(hidden_states)
    value = linear_cat(encoder_hidden_states, attn.add_v_proj.weight, attn.add_v_proj.bias,
                       hidden_states, attn.to_v.weight, attn.to_v.bias, site)
    encoder_query = attn.add_q_proj(encoder_hidden_states)
    encoder_key = attn.add_k_proj(encoder_hidden_states)
    return query, key, encoder_query, encoder_key, value


class FastpathFluxAttnProcessor(FluxAttnProcessor):
    """``FluxAttnProcessor`` whose QK RMSNorm, text/image concatenation of q and k, and rotary embedding run as one
    fused op per tensor (`qk_norm_rope`; where the norm cannot be fused, its fallback keeps the exact fused
    `rotary_emb`). Counts its calls on the attention module's two sites (``[qk_norm_rope]``, ``[rotary_emb]`` in
    `report`); a module without them (not patched by `patch`) runs the same code uncounted.

    ``__call__`` mirrors diffusers 0.42.1's (checked by source digest at patch time); the q/k norm, cat and rotary
    lines are replaced by the fused op; in a joint module whose value projections are plain ``nn.Linear`` layers
    (``[value_cat]``), diffusers' ``_get_projections`` runs as written except that the text and image value projections
    write straight into their concatenation (`_joint_value_projections`); the rest is unchanged.
    """

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        joint = attn.added_kv_proj_dim is not None
        projected = _joint_value_projections(attn, hidden_states, encoder_hidden_states) if joint else None
        if projected is None:
            query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
                attn, hidden_states, encoder_hidden_states
            )
        else:  # value: the text and image values, already joined
            query, key, encoder_query, encoder_key, value = projected

        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))

        if joint:
            encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
            encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
            if projected is None:
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


def _single_block_mlp_unfit(block: FluxSingleTransformerBlock) -> str | None:
    return linear_gelu_unfit(block.proj_mlp, getattr(block.act_mlp, "approximate", None), bypassed=(block.act_mlp,))


def _gelu_unfit(gelu: GELU) -> str | None:
    return linear_gelu_unfit(gelu.proj, gelu.approximate)


def patch_adaln(module: torch.nn.Module, state: PatchState) -> bool:
    """Swap `module` if it is one of diffusers' shared ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle`` (FLUX.1 and
    every family built on them) for its fused subclass, with its site and its ``"high"`` tier site; True if it was."""
    kind = type(module)
    if kind is AdaLayerNormZero and mirrors(AdaLayerNormZero.forward, _ADALN_ZERO_FORWARD):
        state.swap_class(module, FastpathAdaLayerNormZero)
    elif kind is AdaLayerNormZeroSingle and mirrors(AdaLayerNormZeroSingle.forward, _ADALN_ZERO_SINGLE_FORWARD):
        state.swap_class(module, FastpathAdaLayerNormZeroSingle)
    else:
        return False
    state.add_site(module, MODULATE)
    return True


@register_adapter(FluxTransformer2DModel)
def patch_flux(model: FluxTransformer2DModel, state: PatchState) -> None:
    """Swap FLUX.1's adaLN modules, blocks, GELUs and attention processors (see module doc)."""
    swap_block = mirrors(FluxTransformerBlock.forward, _BLOCK_FORWARD)
    swap_single_block = mirrors(FluxSingleTransformerBlock.forward, _SINGLE_BLOCK_FORWARD)

    first_single = model.single_transformer_blocks[0] if len(model.single_transformer_blocks) else None
    for module in model.modules():
        kind = type(module)
        if patch_adaln(module, state) or patch_pos_embed(module, state):
            continue
        if kind is FluxTransformerBlock and swap_block:
            state.swap_class(module, FastpathFluxTransformerBlock)
            state.add_site(module.norm2, MODULATE)
            state.add_site(module.norm2_context, MODULATE)
            for gate in _BLOCK_GATES:
                state.add_site(module, GATED_RESIDUAL, gate)
        elif kind is FluxSingleTransformerBlock and swap_single_block:
            state.swap_class(module, FastpathFluxSingleTransformerBlock)
            if module is first_single:  # its inputs are the dual blocks' two tensors: nothing to save
                state.set_attr(module, site_attr("cat_tokens"), None)
            else:
                state.add_site(module, JOINT_TOKENS_VIEW, "cat_tokens")
            state.add_site(module, GATED_RESIDUAL, "gate")
            if gelu_cat_unfit(module.act_mlp) is None:
                state.add_site(module, GELU_CAT, GELU_CAT)
            else:
                state.set_attr(module, site_attr(GELU_CAT), None)
            mark_site(state, module, LINEAR_GELU, _single_block_mlp_unfit)
        elif kind is GELU:
            state.swap_class(module, FastpathGELU)
            mark_site(state, module, LINEAR_GELU, _gelu_unfit)
    _link_blocks(model, state)
    patch_flux_attention(model, state)


def _link_blocks(model: FluxTransformer2DModel, state: PatchState) -> None:
    """The fused update + LayerNorm-modulate sites (`_handoff`): each patched dual block's ``norm2`` and
    ``norm2_context``; and the hand-offs from each patched block to the adaLNs of the next block of its kind (the
    last dual block's streams are concatenated before the first single block's norm: none there)."""
    duals, singles = list(model.transformer_blocks), list(model.single_transformer_blocks)
    for block in duals:
        if type(block) is FastpathFluxTransformerBlock:
            add_receiver(state, block.norm2)
            add_receiver(state, block.norm2_context)
    for index, (block, nxt) in enumerate(zip(duals, duals[1:])):
        if (type(block) is FastpathFluxTransformerBlock and type(nxt) is FastpathFluxTransformerBlock
                and type(nxt.norm1) is FastpathAdaLayerNormZero and type(nxt.norm1_context) is FastpathAdaLayerNormZero):
            link(state, block, ((nxt.norm1, nxt), (nxt.norm1_context, nxt)), "transformer_blocks", index)
    for index, (block, nxt) in enumerate(zip(singles, singles[1:])):
        if (type(block) is FastpathFluxSingleTransformerBlock and type(nxt) is FastpathFluxSingleTransformerBlock
                and type(nxt.norm) is FastpathAdaLayerNormZeroSingle):
            link(state, block, ((nxt.norm, nxt),), "single_transformer_blocks", index)


def patch_flux_attention(model: torch.nn.Module, state: PatchState) -> None:
    """Give every ``FluxAttention`` of `model` that runs diffusers' ``FluxAttnProcessor`` the fused
    `FastpathFluxAttnProcessor`, with its two sites (FLUX.1 and every family built on FLUX's attention: Chroma)."""
    if mirrors(FluxAttnProcessor.__call__, _PROCESSOR_CALL):
        state.replace_processors(model, FluxAttention, FluxAttnProcessor, FastpathFluxAttnProcessor)
        values = mirrors(_get_projections, _GET_PROJECTIONS)
        for module in model.modules():
            if isinstance(module, FluxAttention) and type(module.processor) is FastpathFluxAttnProcessor:
                state.add_site(module, QK_NORM_ROPE, name=QK_NORM_ROPE)
                state.add_site(module, ROTARY, name=ROTARY)
                if values and module.added_kv_proj_dim is not None and _value_projections_unfit(module) is None:
                    state.add_site(module, VALUE_CAT, name="value_cat")
