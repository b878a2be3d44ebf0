"""FLUX.1's and FLUX.2's VAEs (diffusers' ``AutoencoderKL`` and ``AutoencoderKLFlux2``, and every pipeline's
``AutoencoderKL``: SD3, Chroma, ...), through the shared pieces of `diffusers_fastpath.models.vae`.

Both are ``vae.Encoder`` + ``vae.Decoder`` of ``ResnetBlock2D``s with a mid-block attention. Per FLUX.1 decode
(``block_out_channels`` 128, 256, 512, 512; 32 groups): 29 GroupNorm -> SiLU pairs (``norm1`` and ``norm2`` of the 14
resnets, the decoder's ``conv_norm_out``), each joined with the convolution that reads it (``conv1``, ``conv2``,
``conv_out``: `vae_ltx2_chain.ChainPairCalls`) as `group_norm_silu_conv` (the norm written channels-last for cuDNN;
where it refuses, the pair as `group_norm_silu` and the convolution as `conv_bias`), and the mid-block attention's
``group_norm`` as `group_norm`; per encode 21 pairs (10 resnets and ``conv_norm_out``) and the attention's norm.
Every convolution's bias is added by `conv_bias` (`diffusers_fastpath.models.vae_conv`: 35 a decode, each one vectorised pass instead of aten's
broadcast add after cuDNN's convolution). The convolutions themselves, the attention and the residual adds run as
diffusers wrote them. Tiling and slicing (``enable_tiling``,
``enable_slicing``) call the same blocks on smaller tensors: the same sites, each checked per call by the op's guard.

Measured (H200, torch 2.11, bf16, random weights of the published configs, ``python -m diffusers_fastpath.bench
--model flux-dev --levels vae``, 533694c), bit-identical: FLUX.1's decode at 1024x1024 86.98 -> 41.92 ms (0.482x),
its encode 47.54 -> 24.09 ms (0.507x); FLUX.2's 87.43 -> 42.35 ms (0.484x) and 47.57 -> 24.18 ms (0.508x). In the
patched decode (41.0 ms of kernels) the GroupNorms take 7.0 ms (eager: 52.5 ms with the SiLUs); what remains is the
convolutions (12.4 ms), the convolutions' bias adds, which aten does not vectorise (6.3 ms: 43 broadcast adds; read
then as residual adds), cuDNN's layout conversions (8.0 ms), the attention (3.6 ms). With the joined calls (H100,
session 39, `1f85792`): decode 90.60 -> 37.46 ms (0.413x), encode 0.437x; cuDNN's layout conversions 1.8 ms.
"""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.autoencoders.vae import Decoder, Encoder
from diffusers.models.resnet import ResnetBlock2D

from .._state import PatchState, register_adapter
from ..ops.conv_bias_residual import CONV_BIAS_RESIDUAL
from ..ops.group_norm_silu import group_norm_silu
from ..ops.group_norm_silu_conv import GROUP_NORM_SILU_CONV
from .vae import PAIR_SITE, PairBlock, pair_unfit, patch_group_norm_vae
from .vae_conv import joins_group_norm
from .vae_ltx2_chain import ChainPairCalls, add_chain_sites

# the pairs, each joined with the convolution after it where the forward's form allows (``V = self.<conv>(V)``, the
# last of the run after the pair: `vae_ltx2_chain`); a resnet's ``conv2`` leaves its result without its bias for the
# residual add that reads it (``output_tensor = (input_tensor + hidden_states) / self.output_scale_factor``, right
# before the return: `conv_bias_residual`)
PAIRS = ChainPairCalls("_diffusers_fastpath_vae_kl", PAIR_SITE, pair_unfit, group_norm_silu,
                       chain=GROUP_NORM_SILU_CONV, keyword=None, bias=None, residual=CONV_BIAS_RESIDUAL)

# Made at import, so that a pickled patched model finds the subclasses here by name.
BLOCKS = (
    PairBlock(ResnetBlock2D, "FastpathResnetBlock2D", __name__, ("nonlinearity",), PAIRS),
    PairBlock(Decoder, "FastpathDecoder", __name__, ("conv_act",), PAIRS),
    PairBlock(Encoder, "FastpathEncoder", __name__, ("conv_act",), PAIRS),
)


@register_adapter(AutoencoderKL)
@register_adapter(AutoencoderKLFlux2)
def patch_vae_kl(model, state: PatchState) -> None:
    """Fuse the GroupNorms (and their SiLUs, and the convolutions that read them) of an ``AutoencoderKL``-style VAE
    (see module doc)."""
    patch_group_norm_vae(model, state, BLOCKS)
    # (the joined norm -> SiLU -> convolution calls: a site on each convolution one names)
    add_chain_sites(model, state, {block.sub: PAIRS for block in BLOCKS if block.sub is not None},
                    joins_group_norm)
