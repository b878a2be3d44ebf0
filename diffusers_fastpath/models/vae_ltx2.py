"""LTX-2's VAE (diffusers' ``AutoencoderKLLTX2Video``, the video VAE of every LTX-2 pipeline), through exact pieces.

- The norms (``PerChannelRMSNorm``: ``x / sqrt(mean(x**2, dim=1) + eps)``, `diffusers_fastpath.models.vae_ltx2_norm`):
  a norm whose output goes into the block's SiLU (``norm1 -> nonlinearity`` and ``norm2 -> nonlinearity`` of every
  ``LTX2VideoResnetBlock3d``, around the optional timestep modulate, which the published config leaves off; the
  encoder's and decoder's ``norm_out -> conv_act``) runs with it as
  `diffusers_fastpath.ops.per_channel_rmsnorm_silu` (the block's forward rewritten by the pair rewrite of
  `diffusers_fastpath.models.vae`: the statement pair becomes one call, which takes the fused op only where the norm
  carries this package's site, the activation is exactly ``nn.SiLU`` and neither has hooks); every other such norm
  becomes `FastpathPerChannelRMSNorm`. Both compute x**2 and the channel mean in the kernel, in aten's reduce
  order, where that order is reproduced (`ops.per_channel_rmsnorm.mean_order`; elsewhere aten's square and mean
  run), and fuse the tail.
- The causal convolutions (``LTX2VideoCausalConv3d``: the first frame repeated in time by ``repeat`` and
  ``torch.concatenate``, then the ``nn.Conv3d``, which in the decoder pads by reflection) run as
  `diffusers_fastpath.ops.ltx_causal_conv3d` (`diffusers_fastpath.models.vae_ltx_conv`): the padded input written
  channels-last in one pass, cuDNN's convolution as eager asks it, the bias and the transpose back in one pass.
- The norm -> SiLU pairs joined with the causal convolution after them (`diffusers_fastpath.models.vae_ltx2_chain`:
  `diffusers_fastpath.ops.ltx_norm_conv`, the norm written as the convolution's padded channels-last input); and in
  each resnet, ``conv1``'s result handed to ``norm2``'s chain without its bias pass
  (`diffusers_fastpath.ops.ltx_bias_norm_conv`) where the rewritten forward proves nothing else reads it, and
  ``conv2``'s to the residual add ``hidden_states + inputs``, the bias, the transpose back and the add in one pass
  (`diffusers_fastpath.ops.conv_bias_residual`, site on the resnet).
- The decoder's three upsamplers (``LTX2VideoUpsampler3d``, residual, stride (2, 2, 2)): the convolution's
  channels-last output, its bias, the depth-to-space of it and of the input and the residual add in one pass
  (`diffusers_fastpath.ops.ltx_upsampler3d`, `diffusers_fastpath.models.vae_ltx_upsampler`).
- The convolutions' biases (`diffusers_fastpath.models.vae_conv`): every plain ``nn.Conv3d`` with a bias and zero
  padding (the shortcuts, and the encoder's causal convolutions' ``conv``, for the channels-first path) becomes
  `FastpathConv3d`.

Being the modules' own forwards (or the pair's call in the block's forward), these run inside the module calls, so
hooks run as before. ``PerChannelRMSNorm.forward`` is checked by source digest at patch time; where it is not the form
read here, the norms are left as they are, with one warning. Tiling and slicing call the same modules on smaller
tensors: the same sites, each checked per call by its guard.
"""

from __future__ import annotations

from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

from .._state import PatchState, register_adapter
from ..ops.per_channel_rmsnorm import PER_CHANNEL_RMSNORM, PER_CHANNEL_RMSNORM_SILU, per_channel_rmsnorm_silu
from .vae import PairBlock, silu_pair_unfit, swap_norms
from .vae_conv import swap_convs
from .vae_ltx2_chain import ChainPairCalls, add_chain_sites
from .vae_ltx_conv import FastpathLTX2VideoCausalConv3d, swap_ltx_causal_convs
from .vae_ltx_upsampler import swap_ltx_upsamplers
from .vae_ltx2_norm import FastpathPerChannelRMSNorm, norm_fits

PAIR_SITE = PER_CHANNEL_RMSNORM_SILU.name  # the pair's site, on the norm module


# (per_channel_rmsnorm_silu's)
pair_unfit = silu_pair_unfit(lambda norm: type(norm) is ltx2.PerChannelRMSNorm, "a checked PerChannelRMSNorm")
# (the pairs, each joined with the causal convolution after it where the forward's form allows: `vae_ltx2_chain`)
PAIRS = ChainPairCalls("_diffusers_fastpath_vae_ltx2", PAIR_SITE, pair_unfit, per_channel_rmsnorm_silu)

# Made at import, so that a pickled patched model finds the subclasses here by name.
BLOCKS = tuple(
    PairBlock(base, f"Fastpath{base.__name__}", __name__, (act,), PAIRS)
    for base, act in ((ltx2.LTX2VideoResnetBlock3d, "nonlinearity"), (ltx2.LTX2VideoEncoder3d, "conv_act"),
                      (ltx2.LTX2VideoDecoder3d, "conv_act"))
)


@register_adapter(ltx2.AutoencoderKLLTX2Video)
def patch_ltx2_vae(model, state: PatchState) -> None:
    """Fuse the norms (and their SiLUs), the causal convolutions' padding and the bias adds (see module doc)."""
    fits = norm_fits()
    if fits:
        swap_norms(model, state, BLOCKS, {ltx2.PerChannelRMSNorm: FastpathPerChannelRMSNorm}, PER_CHANNEL_RMSNORM.name)
    swap_ltx_causal_convs(model, state)
    swap_ltx_upsamplers(model, state)
    swap_convs(model, state)
    if fits:  # (the joined norm -> SiLU -> convolution calls: a site on each convolution one names)
        add_chain_sites(model, state, {block.sub: PAIRS for block in BLOCKS if block.sub is not None},
                        lambda conv: type(conv) is FastpathLTX2VideoCausalConv3d)
