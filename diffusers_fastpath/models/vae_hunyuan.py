"""HunyuanVideo's and HunyuanImage-2.1's VAEs (diffusers' ``AutoencoderKLHunyuanVideo`` and
``AutoencoderKLHunyuanImage``), built of the GroupNorm + SiLU pieces that FLUX.1's is, through the shared pieces of
`diffusers_fastpath.models.vae`.

- HunyuanVideo: ``HunyuanVideoResnetBlockCausal3D``'s ``norm1 -> nonlinearity`` and ``norm2 -> nonlinearity`` and the
  encoder's and decoder's ``conv_norm_out -> conv_act`` run as `group_norm_silu` (over ``[B, C, T, H, W]``: a GroupNorm
  of a video is the image one over ``T * H * W``), the mid-block attention's ``group_norm`` as `group_norm`; the
  causal convolutions' ``nn.Conv3d`` (after diffusers' replicate padding, which runs as written) and every other
  convolution with a bias add their bias with `conv_bias`.
- HunyuanImage-2.1 (2-D, 32x spatial compression): ``HunyuanImageResnetBlock``'s two pairs and the encoder's and
  decoder's ``norm_out -> nonlinearity``, each joined with the convolution that reads it (``conv1``, ``conv2``,
  ``conv_out``), as `group_norm_silu_conv` (the norm written channels-last for cuDNN, as FLUX.1's: `vae_kl`; where
  it refuses, the pair as `group_norm_silu` and the convolution with `conv_bias`), the attention block's ``norm`` as
  `group_norm`, the other convolutions' biases with `conv_bias`.

The residual adds, the up- and downsamplers' rearrangements and the attention run as diffusers wrote them. Tiling
and slicing call the same blocks on smaller tensors: the same sites, each checked per call by its op's guard.
"""

from __future__ import annotations

from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hunyuan_video
from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage as hunyuan_image

from .._state import PatchState, register_adapter
from ..ops.group_norm_silu import group_norm_silu
from ..ops.group_norm_silu_conv import GROUP_NORM_SILU_CONV
from .vae import PAIR_SITE, PairBlock, pair_unfit, patch_group_norm_vae
from .vae_conv import joins_group_norm
from .vae_ltx2_chain import ChainPairCalls, add_chain_sites

# the 2-D VAE's pairs, each joined with the convolution after it (as FLUX.1's: `vae_kl`)
IMAGE_PAIRS = ChainPairCalls("_diffusers_fastpath_vae_hunyuan_image", PAIR_SITE, pair_unfit, group_norm_silu,
                             chain=GROUP_NORM_SILU_CONV, keyword=None, bias=None, residual=None)

# Made at import, so that a pickled patched model finds the subclasses here by name.
VIDEO_BLOCKS = tuple(
    PairBlock(base, f"Fastpath{base.__name__}", __name__, (act,))
    for base, act in ((hunyuan_video.HunyuanVideoResnetBlockCausal3D, "nonlinearity"),
                      (hunyuan_video.HunyuanVideoEncoder3D, "conv_act"),
                      (hunyuan_video.HunyuanVideoDecoder3D, "conv_act"))
)
IMAGE_BLOCKS = tuple(
    PairBlock(base, f"Fastpath{base.__name__}", __name__, (act,), IMAGE_PAIRS)
    for base, act in ((hunyuan_image.HunyuanImageResnetBlock, "nonlinearity"),
                      (hunyuan_image.HunyuanImageEncoder2D, "nonlinearity"),
                      (hunyuan_image.HunyuanImageDecoder2D, "nonlinearity"))
)
BLOCKS = VIDEO_BLOCKS + IMAGE_BLOCKS


@register_adapter(hunyuan_video.AutoencoderKLHunyuanVideo)
@register_adapter(hunyuan_image.AutoencoderKLHunyuanImage)
def patch_hunyuan_vae(model, state: PatchState) -> None:
    """Fuse the GroupNorms (and their SiLUs, and in the 2-D VAE the convolutions that read them) and the
    convolutions' bias adds (see module doc)."""
    patch_group_norm_vae(model, state, BLOCKS)
    add_chain_sites(model, state, {block.sub: IMAGE_PAIRS for block in IMAGE_BLOCKS if block.sub is not None},
                    joins_group_norm)
