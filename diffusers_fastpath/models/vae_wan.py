"""Wan's VAE and those built of its pieces (diffusers' ``AutoencoderKLWan``, Wan 2.1 and 2.2; ``AutoencoderKLQwenImage``,
Wan's VAE under other class names; ``AutoencoderKLQwenImage21``, its one-frame image form with 2-D convolutions;
``AutoencoderKLHunyuanVideo15`` and ``AutoencoderKLHunyuanImageRefiner``, whose norm is Wan's, digest for digest),
through exact pieces and the pair rewrite of `diffusers_fastpath.models.vae`.

- The norms (``WanRMS_norm``, ``QwenImageRMS_norm``: ``F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma +
  bias``): a norm whose output goes straight into the block's SiLU module (``norm1 -> nonlinearity`` and ``norm2 ->
  nonlinearity`` of every residual block, ``norm_out -> nonlinearity`` of the encoder and the decoder) runs with it as
  `diffusers_fastpath.ops.channel_rmsnorm_silu` (the block's forward rewritten as the GroupNorm VAEs' are: the
  statement pair becomes one call, which takes the fused op only where the norm carries this package's site, the
  activation is exactly ``nn.SiLU`` and neither has hooks); every other such norm (the mid-block attention's) becomes
  `FastpathWanRMS_norm` / `FastpathQwenImageRMS_norm`, whose forward is `channel_rmsnorm`. Both keep aten's norm
  reduction and fuse the tail (division, cast, scale, gamma, bias, SiLU), exact by construction.
- The causal convolutions (``WanCausalConv3d``, ``QwenImageCausalConv3d``): `FastpathWanCausalConv3d` /
  `FastpathQwenImageCausalConv3d`, whose forward is `diffusers_fastpath.ops.causal_conv3d`: the cache frames and the
  zero padding written around x in one buffer instead of a concatenation, a fill and a copy (values moved, never
  changed; the convolution is the module's own ``nn.Conv3d.forward``).
- The convolutions' biases (`diffusers_fastpath.models.vae_conv`): the causal convolutions' padded input goes to
  `diffusers_fastpath.ops.conv_bias`, the plain ``nn.Conv2d`` / ``nn.Conv3d`` ones (HunyuanVideo-1.5's and the
  refiner's causal convolutions hold one after their replicate padding) become `FastpathConv2d` / `FastpathConv3d`.
  Qwen-Image 2.1's ``QwenImage21CausalConv3d`` is an ``nn.Conv2d`` whose forward pads and calls
  ``super().forward``: `FastpathQwenImage21CausalConv3d` puts `FastpathConv2d` between it and ``nn.Conv2d`` in the
  method order, so that diffusers' forward runs as written and its ``super().forward`` is `conv_bias`.
- The decoders' 2x upsampling (``WanUpsample``, ``QwenImageUpsample``: ``nn.Upsample`` of ``x.float()``, cast back):
  `FastpathWanUpsample` / `FastpathQwenImageUpsample`, whose forward is
  `diffusers_fastpath.ops.upsample_nearest2x`: one read of x and one write of the result instead of an fp32 round
  trip at four times the size (exact by construction).

Being the modules' own forwards, these run inside the module call, so hooks run as before.

The forwards this relies on (the norm's, the convolution's, the upsampling's) are checked by source digest at import and at patch
time; a class whose forward differs is left as it is, with one warning. The caches diffusers keeps between chunks
(``feat_cache``: the blocks' ``x[:, :, -CACHE_T:].clone()``) are made by diffusers' own statements, unchanged.
Tiling and slicing call the same modules on smaller tensors: the same sites, each checked per call by its guard.
"""

from __future__ import annotations

from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage_refiner as refiner
from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hunyuan15
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
from diffusers.models.autoencoders import autoencoder_kl_qwenimage21 as qwen21
from diffusers.models.autoencoders import autoencoder_kl_wan as wan
from torch import nn

from .._state import SITE_ATTR, PatchState, register_adapter
from ..ops.causal_conv_pad import CAUSAL_CONV3D, add_conv_class, causal_conv3d
from ..ops.channel_rmsnorm_silu import (CHANNEL_RMSNORM, CHANNEL_RMSNORM_SILU, add_norm_class, channel_rmsnorm,
                                        channel_rmsnorm_silu)
from ..ops.upsample_nearest import UPSAMPLE_NEAREST2X, add_upsample_class, upsample_nearest2x
from ..ops.conv_bias import CONV_BIAS, add_bias_conv_class
from .vae import PairBlock, PairCalls, checked_forwards, silu_pair_unfit, swap_pair_blocks
from .vae_conv import FastpathConv2d, add_conv_subclass, causal_conv_site, swap_convs

# diffusers 0.42.1's forwards (`_source.body_digest`: the body, without docstring and formatting), the same in both files
NORM_DIGESTS = frozenset({"960a6e5b25f82893"})  # F.normalize(x.float()).to(x.dtype) * self.scale * self.gamma + bias
CONV_DIGESTS = frozenset({"3c4433890f22647d"})  # torch.cat([cache_x, x], dim=2); F.pad; super().forward
UPSAMPLE_DIGESTS = frozenset({"0fefd24a11a840dc"})  # super().forward(x.float()).type_as(x)

PAIR_SITE = CHANNEL_RMSNORM_SILU.name  # the pair's site, on the norm module: ``_fastpath_site_channel_rmsnorm_silu``


def _norm_forward(self, x):
    return channel_rmsnorm(self, x, self.__dict__.get(SITE_ATTR))


def _conv_forward(self, x, cache_x=None):
    return causal_conv3d(self, x, cache_x, self.__dict__.get(SITE_ATTR))


def _upsample_forward(self, x):
    return upsample_nearest2x(self, x, self.__dict__.get(SITE_ATTR))


def _subclass(base: type, name: str, forward, what: str) -> type:
    """A module-level subclass of `base` named `name` whose forward is `forward` (adds no state)."""
    doc = (f"diffusers' ``{base.__qualname__}`` whose forward is {what} (`diffusers_fastpath.models.vae_wan`); "
           f"``{base.__qualname__}.forward`` wherever the guard refuses. Adds no state.")
    cls = type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name, "__doc__": doc})
    globals()[name] = cls
    return cls


NORMS = {base: _subclass(base, f"Fastpath{base.__name__}", _norm_forward, "`channel_rmsnorm`")
         for base in (wan.WanRMS_norm, qwen.QwenImageRMS_norm, qwen21.QwenImage21RMS_norm,
                      hunyuan15.HunyuanVideo15RMS_norm, refiner.HunyuanImageRefinerRMS_norm)}
CONVS = {base: _subclass(base, f"Fastpath{base.__name__}", _conv_forward, "`causal_conv3d`")
         for base in (wan.WanCausalConv3d, qwen.QwenImageCausalConv3d)}
UPSAMPLES = {base: _subclass(base, f"Fastpath{base.__name__}", _upsample_forward, "`upsample_nearest2x`")
             for base in (wan.WanUpsample, qwen.QwenImageUpsample, qwen21.QwenImage21Upsample)}
for _base, _sub in NORMS.items():
    add_norm_class(_sub, _base)
for _base, _sub in CONVS.items():
    add_conv_class(_sub, _base)
    add_bias_conv_class(_sub)  # (its forward hands the padded input to `conv_bias`)
for _base, _sub in UPSAMPLES.items():
    add_upsample_class(_sub, _base)


class FastpathQwenImage21CausalConv3d(qwen21.QwenImage21CausalConv3d, FastpathConv2d):
    """diffusers' ``QwenImage21CausalConv3d`` (an ``nn.Conv2d`` that pads, then calls ``super().forward``) with
    `FastpathConv2d` next in the method order: diffusers' forward runs as written, its ``super().forward`` is
    `conv_bias` (``nn.Conv2d.forward`` wherever the guard refuses). Adds no state."""


add_conv_subclass(FastpathQwenImage21CausalConv3d, qwen21.QwenImage21CausalConv3d)


pair_unfit = silu_pair_unfit(lambda norm: type(norm) in NORMS, "a checked channel RMS norm")  # (channel_rmsnorm_silu's)


PAIRS = PairCalls("_diffusers_fastpath_vae_wan", PAIR_SITE, pair_unfit, channel_rmsnorm_silu)

# Made at import, so that a pickled patched model finds the subclasses here by name.
BLOCKS = tuple(
    PairBlock(base, f"Fastpath{base.__name__}", __name__, (act,), PAIRS)
    for base, act in ((wan.WanResidualBlock, "nonlinearity"), (wan.WanEncoder3d, "nonlinearity"),
                      (wan.WanDecoder3d, "nonlinearity"), (qwen.QwenImageResidualBlock, "nonlinearity"),
                      (qwen.QwenImageEncoder3d, "nonlinearity"), (qwen.QwenImageDecoder3d, "nonlinearity"),
                      (qwen21.QwenImage21ResidualBlock, "nonlinearity"), (qwen21.QwenImage21Encoder3d, "nonlinearity"),
                      (qwen21.QwenImage21Decoder3d, "nonlinearity"), (hunyuan15.HunyuanVideo15ResnetBlock, "nonlinearity"),
                      (hunyuan15.HunyuanVideo15Encoder3D, "conv_act"), (hunyuan15.HunyuanVideo15Decoder3D, "conv_act"),
                      (refiner.HunyuanImageRefinerResnetBlock, "nonlinearity"),
                      (refiner.HunyuanImageRefinerEncoder3D, "conv_act"),
                      (refiner.HunyuanImageRefinerDecoder3D, "conv_act"))
)


@register_adapter(wan.AutoencoderKLWan)
@register_adapter(qwen.AutoencoderKLQwenImage)
@register_adapter(qwen21.AutoencoderKLQwenImage21)
@register_adapter(hunyuan15.AutoencoderKLHunyuanVideo15)
@register_adapter(refiner.AutoencoderKLHunyuanImageRefiner)
def patch_wan_vae(model, state: PatchState) -> None:
    """Fuse the norms (and their SiLUs) and build the causal convolutions' inputs in one buffer (see module doc)."""
    norms = checked_forwards(NORMS, NORM_DIGESTS, None, add_norm_class)
    convs = checked_forwards(CONVS, CONV_DIGESTS, nn.Conv3d, add_conv_class)
    upsamples = checked_forwards(UPSAMPLES, UPSAMPLE_DIGESTS, nn.Upsample, add_upsample_class)
    paired = swap_pair_blocks(model, state, BLOCKS, lambda norm, act: type(norm) in norms and type(act) is nn.SiLU)
    for module in model.modules():
        cls = type(module)
        if cls in norms and id(module) not in paired:
            state.swap_class(module, NORMS[cls])
            state.add_site(module, CHANNEL_RMSNORM.name)
        elif cls in convs:
            state.swap_class(module, CONVS[cls])
            state.add_site(module, CAUSAL_CONV3D.name)
            causal_conv_site(module, state)
        elif cls in upsamples:
            state.swap_class(module, UPSAMPLES[cls])
            state.add_site(module, UPSAMPLE_NEAREST2X.name)
        elif cls is qwen21.QwenImage21CausalConv3d and module.bias is not None:
            state.swap_class(module, FastpathQwenImage21CausalConv3d)
            state.add_site(module, CONV_BIAS.name)
    swap_convs(model, state)  # the plain ones (the resampling's nn.Conv2d, the attention's 1x1)
