"""Hunyuan DiT adapter: diffusers' ``HunyuanVideoTransformer3DModel`` (HunyuanVideo, its I2V and token-replace
variants, FramePack's backbone aside) and ``HunyuanImageTransformer2DModel`` (HunyuanImage-2.1), through the shared
pieces. Both are FLUX.1's architecture with a text token refiner in front; nothing of theirs is copied here:

- the shared ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle`` modules get FLUX.1's fused subclasses
  (`flux.patch_adaln`): LayerNorm + modulate in one kernel;
- the blocks' forwards are rewritten from the installed diffusers source (`diffusers_fastpath.models._chains`): the
  dual blocks' second modulates (``norm2``, ``norm2_context``: normalised together, then modulated together) as the
  fused `layernorm_scale_shift`, every gated residual (dual blocks, single blocks, the refiner's) as the fused
  `gated_residual`, the single blocks' tanh-GELU + concatenation as the fused `gelu_cat`;
- the text token refiners build their pairwise attention mask by broadcasting (the rewriter's pairwise-mask form,
  exact by construction);
- the patch embeddings hand the blocks their tokens contiguous (`FastpathHunyuanVideoPatchEmbed`: diffusers' are a
  transposed view, a layout the dual blocks' image stream keeps, so every one of their LayerNorm + modulate and gated
  residual sites would fall back);
- the attention processors (``HunyuanVideoAttnProcessor2_0``, ``HunyuanImageAttnProcessor``) are rewritten for the
  exact fused `rotary_emb` of q and k (the joint single-stream path's image part too: a view of the joint sequence,
  which the op takes where it is contiguous, batch 1, and otherwise leaves to diffusers' function).

HunyuanVideo-1.5 (``HunyuanVideo15Transformer3DModel``: dual-stream blocks only, image tokens first) through the same
pieces: FLUX.1's fused ``AdaLayerNormZero`` (``norm1``, ``norm1_context``), its blocks' gated residuals and second
modulates, the refiner's gated residuals, the rotary embedding of the image q and k, contiguous patch tokens; and the
pairwise attention mask its processor rebuilds in every layer (``repeat``, a transposed read, ``&``: 97.5 ms of a
1,134 ms 480p step) built by broadcasting instead, exact by construction (the rewriter's pairwise-mask form; the
text refiner's mask too).

The QK norms (diffusers' ``RMSNorm`` over head_dim 128): HunyuanVideo-1.5's image q and k's with the rotary after
them as one kernel (`rmsnorm_rope_real`, in the rewritten processor); every other one (HunyuanVideo's and
HunyuanImage-2.1's four per attention, whose rotary takes a slice of the normalised q and k; HunyuanVideo-1.5's text
stream's) as the fused `rmsnorm` alone (`_qk_norms.FastpathRMSNorm`).

Not fused yet (issue 15): the FFN GELUs, the output ``AdaLayerNormContinuous``.
"""

from __future__ import annotations

from diffusers.models.attention_processor import Attention
from diffusers.models.transformers import transformer_hunyuan_video as video
from diffusers.models.transformers import transformer_hunyuan_video15 as video15
from diffusers.models.transformers import transformer_hunyuanimage as image

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, replace_processors, rewrite_of, swap_rewritten
from ._qk_norms import QK_NORMS, patch_qk_rmsnorms
from .flux import patch_adaln


def _fused(module, class_name: str, method: str = "forward"):
    cls = getattr(module, class_name)
    return cls, fused_subclass(cls, f"Fastpath{class_name}", __name__, method)


# Created at import, as attributes of this module named Fastpath<diffusers name> (`fused_subclass` sets them), so
# that a pickled patched model finds them here by name.
_VIDEO_BLOCKS = dict(_fused(video, n) for n in ("HunyuanVideoTransformerBlock", "HunyuanVideoSingleTransformerBlock",
                                                "HunyuanVideoTokenReplaceTransformerBlock",
                                                "HunyuanVideoTokenReplaceSingleTransformerBlock",
                                                "HunyuanVideoIndividualTokenRefinerBlock",
                                                "HunyuanVideoIndividualTokenRefiner"))
_IMAGE_BLOCKS = dict(_fused(image, n) for n in ("HunyuanImageTransformerBlock", "HunyuanImageSingleTransformerBlock",
                                                "HunyuanImageIndividualTokenRefinerBlock",
                                                "HunyuanImageIndividualTokenRefiner"))
_VIDEO15_BLOCKS = dict(_fused(video15, n) for n in ("HunyuanVideo15TransformerBlock",
                                                    "HunyuanVideo15IndividualTokenRefinerBlock",
                                                    "HunyuanVideo15IndividualTokenRefiner"))
_PROCESSORS = dict(_fused(m, n, "__call__") for m, n in ((video, "HunyuanVideoAttnProcessor2_0"),
                                                          (image, "HunyuanImageAttnProcessor"),
                                                          (video15, "HunyuanVideo15AttnProcessor2_0")))


class FastpathHunyuanVideoPatchEmbed(video.HunyuanVideoPatchEmbed):
    """diffusers' ``HunyuanVideoPatchEmbed`` with its tokens made contiguous once. diffusers returns the convolution's
    ``[B, C, F, H, W]`` output as a transposed ``[B, N, C]`` view; the dual blocks' residual adds keep that layout, so
    each of their LayerNorms copies it and the fused kernels (rows in memory) refuse it. Until the single blocks'
    concatenation (contiguous either way) the image stream feeds only elementwise ops and LayerNorms, which read a
    contiguous copy of it: the same bits, one copy instead of two per dual block. No state of its own."""

    def forward(self, hidden_states):
        return super().forward(hidden_states).contiguous()


class FastpathHunyuanImagePatchEmbed(image.HunyuanImagePatchEmbed):
    """HunyuanImage-2.1's ``HunyuanImagePatchEmbed`` with its tokens made contiguous once (as
    `FastpathHunyuanVideoPatchEmbed`, for the same reason and with the same bits)."""

    def forward(self, hidden_states):
        return super().forward(hidden_states).contiguous()


class FastpathHunyuanVideo15PatchEmbed(video15.HunyuanVideo15PatchEmbed):
    """HunyuanVideo-1.5's ``HunyuanVideo15PatchEmbed`` with its tokens made contiguous once (as
    `FastpathHunyuanVideoPatchEmbed`, for the same reason and with the same bits)."""

    def forward(self, hidden_states):
        return super().forward(hidden_states).contiguous()


_EMBEDS = {video.HunyuanVideoPatchEmbed: FastpathHunyuanVideoPatchEmbed,
           image.HunyuanImagePatchEmbed: FastpathHunyuanImagePatchEmbed,
           video15.HunyuanVideo15PatchEmbed: FastpathHunyuanVideo15PatchEmbed}


def _patch(model, state: PatchState, blocks: dict, processor: type) -> None:
    fused, _ = _PROCESSORS[processor]
    found = rewrite_of(fused) if fused is not None else None  # of the __call__ the processor class holds now
    # the QK norms the rewritten processor does not run with the rotary after them (HunyuanVideo's and
    # HunyuanImage-2.1's four: their rotary takes a slice of the normalised q and k; HunyuanVideo-1.5's text stream's)
    # as the fused norm alone; those it fuses keep diffusers' class, by which the processor recognises them
    alone = tuple(n for n in QK_NORMS if found is None or n not in found.qk_norms)
    for module in model.modules():
        patch_adaln(module, state)
        if type(module) in _EMBEDS:
            state.swap_class(module, _EMBEDS[type(module)])
        elif isinstance(module, Attention):
            patch_qk_rmsnorms(module, state, alone)
    swap_rewritten(state, model, blocks)
    replace_processors(state, model, Attention, processor, fused)


@register_adapter(video.HunyuanVideoTransformer3DModel)
def patch_hunyuan_video(model: video.HunyuanVideoTransformer3DModel, state: PatchState) -> None:
    """Swap HunyuanVideo's adaLN modules, blocks and attention processors for their fused subclasses (module doc)."""
    _patch(model, state, _VIDEO_BLOCKS, video.HunyuanVideoAttnProcessor2_0)


@register_adapter(image.HunyuanImageTransformer2DModel)
def patch_hunyuan_image(model: image.HunyuanImageTransformer2DModel, state: PatchState) -> None:
    """Swap HunyuanImage-2.1's adaLN modules, blocks and attention processors for their fused subclasses."""
    _patch(model, state, _IMAGE_BLOCKS, image.HunyuanImageAttnProcessor)


@register_adapter(video15.HunyuanVideo15Transformer3DModel)
def patch_hunyuan_video15(model: video15.HunyuanVideo15Transformer3DModel, state: PatchState) -> None:
    """Swap HunyuanVideo-1.5's adaLN modules, blocks, text refiner and attention processors for their fused
    subclasses (module doc)."""
    _patch(model, state, _VIDEO15_BLOCKS, video15.HunyuanVideo15AttnProcessor2_0)
