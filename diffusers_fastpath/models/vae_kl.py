"""FLUX.1's and FLUX.2's VAEs (diffusers' ``AutoencoderKL`` and ``AutoencoderKLFlux2``, and every pipeline's
``AutoencoderKL``: SD3, Chroma, ...), through the shared pieces of `diffusers_fastpath.models.vae`.

Both are ``vae.Encoder`` + ``vae.Decoder`` of ``ResnetBlock2D``s with a mid-block attention. Per FLUX.1 decode at
1024x1024 (``block_out_channels`` 128, 256, 512, 512; 32 groups): 29 GroupNorm -> SiLU pairs (``norm1`` and ``norm2``
of the 14 resnets, the decoder's ``conv_norm_out``) as `group_norm_silu`, and the mid-block attention's
``group_norm`` as `group_norm`; the encoder likewise (11 resnets). The convolutions, the attention and the residual
adds run as diffusers wrote them. Tiling and slicing (``enable_tiling``, ``enable_slicing``) call the same blocks on
smaller tensors: the same sites, each checked per call by the op's guard.
"""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.autoencoders.vae import Decoder, Encoder
from diffusers.models.resnet import ResnetBlock2D

from .._state import PatchState, register_adapter
from .vae import PairBlock, patch_group_norm_vae

# Made at import, so that a pickled patched model finds the subclasses here by name.
BLOCKS = (
    PairBlock(ResnetBlock2D, "FastpathResnetBlock2D", __name__, ("nonlinearity",)),
    PairBlock(Decoder, "FastpathDecoder", __name__, ("conv_act",)),
    PairBlock(Encoder, "FastpathEncoder", __name__, ("conv_act",)),
)


@register_adapter(AutoencoderKL)
@register_adapter(AutoencoderKLFlux2)
def patch_vae_kl(model, state: PatchState) -> None:
    """Fuse the GroupNorms (and their SiLUs) of an ``AutoencoderKL``-style VAE (see module doc)."""
    patch_group_norm_vae(model, state, BLOCKS)
