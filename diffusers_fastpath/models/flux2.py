"""FLUX.2 adapter: diffusers' ``Flux2Transformer2DModel`` (FLUX.2-dev, the klein models), through the shared pieces.

Nothing of FLUX.2 is copied here. Its blocks' forwards and its two attention processors are rewritten from the
installed diffusers source (`diffusers_fastpath.models._chains`):

- every LayerNorm + modulate (``(1 + scale) * norm(x) + shift`` and ``norm(x) * (1 + scale) + shift``, with the rows
  of one ``Flux2Modulation`` output) runs as the fused `layernorm_scale_shift` (D up to 6144: FLUX.2-dev and the
  klein models);
- every gated residual (``hidden_states + gate * update``) as the fused `gated_residual`;
- in ``Flux2AttnProcessor`` and ``Flux2ParallelSelfAttnProcessor``, the QK ``torch.nn.RMSNorm``s, the text/image
  concatenation and the rotary embedding of q and of k as one `qk_norm_rope` each (FLUX.1's kernel, self-verified per
  dtype and head dim; where it cannot run, the norms run eagerly and the rotary embedding as the exact fused
  `rotary_emb`).

- ``Flux2SwiGLU`` (the feed-forwards' activation and the parallel single blocks' MLP activation):
  ``gate_fn(x[..., :half]) * x[..., half:]`` as the fused `silu_mul` (its SiLU proven on every bf16/fp16 value on first
  use; the halves are taken as views, no copy); in the parallel single blocks, where the concatenation with the
  attention output follows it (``torch.cat([attn_output, mlp_act_fn(mlp)], dim=-1)``), as the fused `swiglu_cat`,
  which writes the SwiGLU into its columns of the concatenation (the installed ``Flux2SwiGLU.forward`` checked by
  digest first).
The KV-cache processors (``Flux2KV...``) are left as they are.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    Flux2SingleTransformerBlock,
    Flux2SwiGLU,
    Flux2Transformer2DModel,
    Flux2TransformerBlock,
)

from .._state import PatchState, register_adapter
from ._chain_calls import register_swiglu
from ._chains import fused_subclass, replace_processors, swap_rewritten
from ._mirror import mirrors

# Created at import, so that a pickled patched model finds them here by name.
FastpathFlux2TransformerBlock, _BLOCK = fused_subclass(Flux2TransformerBlock, "FastpathFlux2TransformerBlock", __name__)
FastpathFlux2SingleTransformerBlock, _SINGLE = fused_subclass(
    Flux2SingleTransformerBlock, "FastpathFlux2SingleTransformerBlock", __name__)
FastpathFlux2AttnProcessor, _ = fused_subclass(Flux2AttnProcessor, "FastpathFlux2AttnProcessor", __name__, "__call__")
FastpathFlux2ParallelSelfAttnProcessor, _ = fused_subclass(
    Flux2ParallelSelfAttnProcessor, "FastpathFlux2ParallelSelfAttnProcessor", __name__, "__call__",
    swiglus=("mlp_act_fn",))

FastpathFlux2SwiGLU, _SWIGLU = fused_subclass(Flux2SwiGLU, "FastpathFlux2SwiGLU", __name__, activations=("gate_fn",))
_SWIGLU_FORWARD = "0caf2addea5d5fce"  # Flux2SwiGLU.forward: gate_fn(x[..., :half]) * x[..., half:]

_SWAPS = {Flux2TransformerBlock: (FastpathFlux2TransformerBlock, _BLOCK),
          Flux2SingleTransformerBlock: (FastpathFlux2SingleTransformerBlock, _SINGLE),
          Flux2SwiGLU: (FastpathFlux2SwiGLU, _SWIGLU)}


@register_adapter(Flux2Transformer2DModel)
def patch_flux2(model: Flux2Transformer2DModel, state: PatchState) -> None:
    """Swap FLUX.2's blocks and default attention processors for their chain-fused subclasses (see module doc)."""
    if FastpathFlux2SwiGLU is not None and mirrors(Flux2SwiGLU.forward, _SWIGLU_FORWARD):
        register_swiglu(FastpathFlux2SwiGLU, "gate_fn")
    swap_rewritten(state, model, _SWAPS)
    replace_processors(state, model, Flux2Attention, Flux2AttnProcessor, FastpathFlux2AttnProcessor)
    replace_processors(state, model, Flux2ParallelSelfAttention, Flux2ParallelSelfAttnProcessor,
                       FastpathFlux2ParallelSelfAttnProcessor)
