"""SD3 adapter: diffusers' ``SD3Transformer2DModel`` (Stable Diffusion 3 and 3.5: medium, large, large turbo),
through the shared pieces.

- The shared ``AdaLayerNormZero`` modules (``norm1``, and ``norm1_context`` in every block but the last) get FLUX.1's
  fused subclass (`flux.patch_adaln`): LayerNorm + modulate in one kernel.
- The blocks (``JointTransformerBlock``, shared with other MMDiT models in ``diffusers.models.attention``, swapped
  here only inside an SD3 model; and ``SD3SingleTransformerBlock``) are rewritten from the installed source
  (`diffusers_fastpath.models._chains`): the second modulate of each stream (``norm2``, ``norm2_context``) as the
  fused `layernorm_scale_shift`, every gated residual (``gate_msa``, SD3.5's ``gate_msa2``, ``gate_mlp``, and the
  context stream's) as the fused `gated_residual`.

- SD3.5's ``SD35AdaLayerNormZeroX`` (the dual-attention blocks of SD3.5 medium: one LayerNorm, two modulates of its
  output) is rewritten too: its LayerNorm stays eager and both modulates run as the fused, exact
  `modulate_scale_shift`.

- The QK norms of every attention (``norm_q``, ``norm_k``, ``norm_added_q``, ``norm_added_k``: diffusers' ``RMSNorm``
  over head_dim 64 rows of the ``[B, H, S, D]`` views) get `_qk_norms.FastpathRMSNorm`, whose forward is the
  fused, self-verified `diffusers_fastpath.ops.rmsnorm` (seven eager kernels, each over the whole q or k in fp32, as
  one).

- The joint attention's processor (``JointAttnProcessor2_0``, diffusers' default for SD3's attention) is rewritten:
  its three concatenations of the image and text q, k and v (``[B, H, S, D]`` views of ``[B, S, H, D]``
  projections, which aten's ``cat`` copies element by element) run as the fused `diffusers_fastpath.ops.cat_heads`,
  one vectorised copy each (the rewriter's head-concatenation form); and, since only the attention reads them,
  they are written token-major (``[B, S, H, D]`` memory, the projections' own layout) and the attention runs on them
  as `diffusers_fastpath.ops.attention_seq_major` (self-verified per signature: its output is then token-major too,
  and the processor's ``transpose(1, 2).reshape(...)`` after it a view instead of a copy). Attention modules running
  another processor keep it.

Not fused yet: the last block's ``AdaLayerNormContinuous``, the FFN GELUs. SD3 has no rotary embedding.
"""

from __future__ import annotations

from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0
from diffusers.models.normalization import SD35AdaLayerNormZeroX
from diffusers.models.transformers.transformer_sd3 import SD3SingleTransformerBlock, SD3Transformer2DModel

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, replace_processors, swap_rewritten
from ._qk_norms import patch_qk_rmsnorms
from .flux import patch_adaln

# Created at import, so that a pickled patched model finds them here by name.
FastpathJointTransformerBlock, _JOINT = fused_subclass(JointTransformerBlock, "FastpathJointTransformerBlock", __name__)
FastpathSD3SingleTransformerBlock, _SINGLE = fused_subclass(
    SD3SingleTransformerBlock, "FastpathSD3SingleTransformerBlock", __name__)
FastpathSD35AdaLayerNormZeroX, _NORM_X = fused_subclass(SD35AdaLayerNormZeroX, "FastpathSD35AdaLayerNormZeroX", __name__)


FastpathJointAttnProcessor2_0, _PROCESSOR = fused_subclass(
    JointAttnProcessor2_0, "FastpathJointAttnProcessor2_0", __name__, "__call__", head_cats=True)

_SWAPS = {JointTransformerBlock: (FastpathJointTransformerBlock, _JOINT),
          SD3SingleTransformerBlock: (FastpathSD3SingleTransformerBlock, _SINGLE),
          SD35AdaLayerNormZeroX: (FastpathSD35AdaLayerNormZeroX, _NORM_X)}


@register_adapter(SD3Transformer2DModel)
def patch_sd3(model: SD3Transformer2DModel, state: PatchState) -> None:
    """Swap SD3's adaLN modules and blocks for their fused subclasses (see module doc)."""
    for module in model.modules():
        patch_adaln(module, state)
        if isinstance(module, Attention):
            patch_qk_rmsnorms(module, state)
    swap_rewritten(state, model, _SWAPS)
    replace_processors(state, model, Attention, JointAttnProcessor2_0, FastpathJointAttnProcessor2_0)
