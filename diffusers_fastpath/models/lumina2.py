"""Lumina2 adapter: diffusers' ``Lumina2Transformer2DModel`` (Lumina-Image 2.0, ``Lumina2Pipeline``), through the
shared pieces: Z-Image's sandwich norms and SwiGLU, nothing copied.

Lumina2 is Z-Image's ancestor: RMSNorms on both sides of each branch, tanh gates. Rewritten from the installed
diffusers source (`diffusers_fastpath.models._chains`):

- ``LuminaRMSNormZero.forward`` (every modulated block's ``norm1``): ``self.norm(x) * (1 + scale_msa[:, None])`` as
  the fused `rmsnorm_scale`;
- ``Lumina2TransformerBlock.forward``, in the modulated blocks (the joint layers and the noise refiner; the context
  refiner has no modulation and stays as it is): the FFN input ``self.ffn_norm1(x) * (1 + scale_mlp.unsqueeze(1))``
  as `rmsnorm_scale`, both branch outputs ``x + gate.unsqueeze(1).tanh() * self.norm2(attn_output)`` (and the FFN's)
  as `rmsnorm_gated_residual`;
- ``LuminaFeedForward.forward`` (every block's): ``self.silu(self.linear_1(x)) * self.linear_3(x)`` inside
  ``self.linear_2(...)`` as `silu_mul` (the activation is diffusers' ``FP32SiLU``, which the op's proof covers);
- its attention processor, diffusers' ``Lumina2AttnProcessor2_0``, is rewritten: each QK norm (``norm_q``,
  ``norm_k``: diffusers' RMSNorm over head_dim 96) waits for the complex-form rotary after it, diffusers'
  ``apply_rotary_emb(x, freqs, use_real=False)`` (checked by the digest of its installed source), and the two run
  as the fused `rmsnorm_rope_complex` (Qwen-Image's and Z-Image's op, with Lumina2's per-sample ``[B, S, D/2]``
  factors, which its rotary embedder builds in complex128: the kernel's double-precision epilogue). Where the
  processor is another, its QK norms run as the fused `rmsnorm` (`_qk_norms.FastpathRMSNorm`).

Per Lumina-Image 2.0 step (26 layers, 2 noise-refiner and 2 context-refiner blocks): 56 + 56 RMSNorm + scale, 56
RMSNorm + gated residual, 30 SwiGLU and 30 QK norm + rotary sites (two calls each: q and k).

CUDA graphs: the forward reads its caption lengths on the host (``Lumina2RotaryPosEmbed.forward``:
``attention_mask.sum(dim=1).tolist()``, which sets the sequence layout and every loop after it) and copies its CPU
rotary tables to the device (``_get_freqs_cis``: ``self.freqs_cis[i].to(ids.device)``), neither of which a capture
allows. So the lengths are the model's host key (`diffusers_fastpath.graphs.register_host_key`: read before each
call, part of the graph's signature, so a graph recorded for some lengths is never replayed for others), and while a
signature records, its capture twins give the rotary embedder a host copy of the mask (the same lengths, read without
waiting on the GPU) and device copies of its tables (the same values): the recorded kernels are the eager ones, and
the first replay is compared with the eager forward as always.
"""

from __future__ import annotations

import torch
from diffusers.models import embeddings
from diffusers.models.attention import LuminaFeedForward
from diffusers.models.attention_processor import Attention
from diffusers.models.normalization import LuminaRMSNormZero
from diffusers.models.transformers.transformer_lumina2 import (Lumina2AttnProcessor2_0, Lumina2RotaryPosEmbed,
                                                               Lumina2Transformer2DModel, Lumina2TransformerBlock)

from .. import graphs
from .._state import PatchState, register_adapter
from ._chain_pending import register_complex_rotary
from ._chains import fused_subclass, replace_processors, swap_rewritten
from ._mirror import mirrors
from ._qk_norms import patch_qk_rmsnorms

# sha256[:16] of diffusers 0.42.1's embeddings.apply_rotary_emb: its use_real=False branch is rmsnorm_rope_complex's
# reference for [B, S, D/2] factors (unsqueezed at dim 2)
_ROTARY = "a25267d425f8c5ea"

# Created at import, so that a pickled patched model finds them here by name.
FastpathLuminaRMSNormZero, _NORM_ZERO = fused_subclass(LuminaRMSNormZero, "FastpathLuminaRMSNormZero", __name__,
                                                       rms_norms=("norm",))
FastpathLumina2TransformerBlock, _BLOCK = fused_subclass(Lumina2TransformerBlock, "FastpathLumina2TransformerBlock",
                                                         __name__, rms_norms=("norm2", "ffn_norm1", "ffn_norm2"))
FastpathLuminaFeedForward, _FEED_FORWARD = fused_subclass(LuminaFeedForward, "FastpathLuminaFeedForward", __name__,
                                                          activations=("silu",))

FastpathLumina2AttnProcessor, _ = fused_subclass(Lumina2AttnProcessor2_0, "FastpathLumina2AttnProcessor", __name__,
                                                 "__call__", complex_rotary="apply_rotary_emb")

_SWAPS = {LuminaRMSNormZero: (FastpathLuminaRMSNormZero, _NORM_ZERO),
          Lumina2TransformerBlock: (FastpathLumina2TransformerBlock, _BLOCK),
          LuminaFeedForward: (FastpathLuminaFeedForward, _FEED_FORWARD)}


@register_adapter(Lumina2Transformer2DModel)
def patch_lumina2(model: Lumina2Transformer2DModel, state: PatchState) -> None:
    """Swap Lumina2's modulated blocks, their ``LuminaRMSNormZero`` and every feed-forward for their chain-fused
    subclasses (see module doc)."""
    fused_processor = FastpathLumina2AttnProcessor
    if fused_processor is not None and not mirrors(embeddings.apply_rotary_emb, _ROTARY):
        fused_processor = None  # diffusers' rotary is not the op's reference: its QK norms alone run fused
    if fused_processor is not None:
        register_complex_rotary(embeddings.apply_rotary_emb, per_sample=True)
        replace_processors(state, model, Attention, Lumina2AttnProcessor2_0, fused_processor)
    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is not fused_processor:
            patch_qk_rmsnorms(module, state, ("norm_q", "norm_k"))
    swap_rewritten(state, model, _SWAPS,
                   lambda module: type(module) is not Lumina2TransformerBlock or module.modulation)


def _caption_lengths(model: Lumina2Transformer2DModel, call: dict):
    """The host key of a Lumina2 forward (`graphs.HOST_KEYS`): the caption lengths its rotary embedder reads from
    ``encoder_attention_mask``, and, for a recording, the mask on the host and the embedder's tables on the device."""
    mask = call.get("encoder_attention_mask")
    if not isinstance(mask, torch.Tensor):
        return None, None
    host_mask = mask.to("cpu")  # waits for the GPU, as the eager forward's .tolist() does
    rope = model.rope_embedder

    def side():
        device = mask.device
        return host_mask, {id(rope): [f.to(device) for f in rope.freqs_cis]}

    return tuple(host_mask.sum(dim=1).tolist()), side


def _rope_forward_twin(self, hidden_states, attention_mask):
    """`Lumina2RotaryPosEmbed.forward` while a graph records: the host copy of the mask (the same lengths)."""
    side = graphs.capture_side()
    return _ROPE_FORWARD(self, hidden_states, attention_mask if side is None else side[0])


def _freqs_twin(self, ids):
    """`Lumina2RotaryPosEmbed._get_freqs_cis` while a graph records: its tables already on the device (``.to`` of
    them is then no copy), the same values."""
    side = graphs.capture_side()
    tables = None if side is None else side[1].get(id(self))
    if tables is None:
        return _GET_FREQS(self, ids)
    saved, self.freqs_cis = self.freqs_cis, tables
    try:
        return _GET_FREQS(self, ids)
    finally:
        self.freqs_cis = saved


_ROPE_FORWARD, _GET_FREQS = Lumina2RotaryPosEmbed.forward, Lumina2RotaryPosEmbed._get_freqs_cis
graphs.register_host_key(Lumina2Transformer2DModel, _caption_lengths)
graphs.register_capture_twin(Lumina2Transformer2DModel, Lumina2RotaryPosEmbed, "forward", _rope_forward_twin)
graphs.register_capture_twin(Lumina2Transformer2DModel, Lumina2RotaryPosEmbed, "_get_freqs_cis", _freqs_twin)
