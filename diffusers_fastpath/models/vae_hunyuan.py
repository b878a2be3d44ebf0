"""HunyuanVideo's and HunyuanImage-2.1's VAEs (diffusers' ``AutoencoderKLHunyuanVideo`` and
``AutoencoderKLHunyuanImage``), built of the GroupNorm + SiLU pieces that FLUX.1's is, through the shared pieces of
`diffusers_fastpath.models.vae`.

- HunyuanVideo: ``HunyuanVideoResnetBlockCausal3D``'s ``norm1 -> nonlinearity`` and ``norm2 -> nonlinearity`` and the
  encoder's and decoder's ``conv_norm_out -> conv_act`` run as `group_norm_silu` (over ``[B, C, T, H, W]``: a GroupNorm
  of a video is the image one over ``T * H * W``), the mid-block attention's ``group_norm`` as `group_norm`; the
  causal convolutions' ``nn.Conv3d`` (after diffusers' replicate padding, which runs as written) and every other
  convolution with a bias add their bias with `conv_bias`.
- HunyuanImage-2.1 (2-D, 32x spatial compression): ``HunyuanImageResnetBlock``'s two pairs and the encoder's and
  decoder's ``norm_out -> nonlinearity`` as `group_norm_silu`, the attention block's ``norm`` as `group_norm`, the
  convolutions' biases with `conv_bias`.

The residual adds, the up- and downsamplers' rearrangements and the attention run as diffusers wrote them. Tiling
and slicing call the same blocks on smaller tensors: the same sites, each checked per call by its op's guard.
"""

from __future__ import annotations

from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hunyuan_video
from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage as hunyuan_image

from .._state import PatchState, register_adapter
from .vae import PairBlock, patch_group_norm_vae

# Made at import, so that a pickled patched model finds the subclasses here by name.
BLOCKS = tuple(
    PairBlock(base, f"Fastpath{base.__name__}", __name__, (act,))
    for base, act in ((hunyuan_video.HunyuanVideoResnetBlockCausal3D, "nonlinearity"),
                      (hunyuan_video.HunyuanVideoEncoder3D, "conv_act"),
                      (hunyuan_video.HunyuanVideoDecoder3D, "conv_act"),
                      (hunyuan_image.HunyuanImageResnetBlock, "nonlinearity"),
                      (hunyuan_image.HunyuanImageEncoder2D, "nonlinearity"),
                      (hunyuan_image.HunyuanImageDecoder2D, "nonlinearity"))
)


@register_adapter(hunyuan_video.AutoencoderKLHunyuanVideo)
@register_adapter(hunyuan_image.AutoencoderKLHunyuanImage)
def patch_hunyuan_vae(model, state: PatchState) -> None:
    """Fuse the GroupNorms (and their SiLUs) and the convolutions' bias adds (see module doc)."""
    patch_group_norm_vae(model, state, BLOCKS)
