"""LTX-Video's VAE (diffusers' ``AutoencoderKLLTXVideo``: LTX-Video 0.9.0 to 0.9.8, the timestep-conditioned decoders
of 0.9.1+ included), through exact pieces.

- The causal convolutions (``LTXVideoCausalConv3d``: the first frame repeated by ``repeat`` and
  ``torch.concatenate``, then the ``nn.Conv3d``) run as `diffusers_fastpath.ops.ltx_causal_conv3d`
  (`diffusers_fastpath.models.vae_ltx_conv`): the padded input written channels-last in one pass, cuDNN's
  convolution, the bias and the transpose back in one pass (checked per convolution signature). Their ``conv`` (an
  ``nn.Conv3d``) becomes `FastpathConv3d` (`diffusers_fastpath.models.vae_conv`: one vectorised pass for the bias,
  exact by construction), which the channels-first path (fp32, a refused call) runs.
- The residual upsamplers of 0.9.5+ (``LTXVideoUpsampler3d``, stride (2, 2, 2), upscale factor 2): the convolution's
  channels-last output, its bias, the depth-to-space of it and of the input and the residual add in one pass
  (`diffusers_fastpath.ops.ltx_upsampler3d`, `diffusers_fastpath.models.vae_ltx_upsampler`); 0.9.0's (no residual)
  run as written, their convolutions as above.
- The norms: every diffusers ``RMSNorm`` of the VAE without weight (``norm1`` and ``norm2`` of each
  ``LTXVideoResnetBlock3d``, the encoder's and the decoder's ``norm_out``: each called on the channel-last view
  ``x.movedim(1, -1)`` of a channel-first activation) becomes `FastpathLTXRMSNorm`, whose forward is
  `diffusers_fastpath.ops.ltx_rmsnorm`: the fp32 squares in one pass, aten's mean and rsqrt as eager runs them, then
  the multiply and the cast in one pass (exact by construction; the first call of each dtype compared with eager).
  Being the module's own forward, it runs inside the module call, so the module's hooks and the global ones run as
  before. The shortcut's ``norm3`` (an ``nn.LayerNorm``) and everything else run as diffusers wrote them.
- The SiLU after each norm: a norm whose output goes into the block's SiLU (``norm1 -> nonlinearity`` and ``norm2 ->
  nonlinearity`` of every resnet, around its timestep modulate where ``timestep_conditioning`` builds one; the
  encoder's ``norm_out -> conv_act``, the decoder's around its modulate likewise) runs with it as
  `diffusers_fastpath.ops.ltx_vae_rmsnorm_silu` (one pass: the SiLU applied to the norm's rounded output in the
  kernel's epilogue, proven on every value of the dtype on first use). The blocks' forwards are rewritten by the pair
  rewrite of `diffusers_fastpath.models.vae` as LTX-2's are (its ``moved`` form: the statement ``V =
  self.norm(V.movedim(1, -1)).movedim(-1, 1)`` then ``V = self.nonlinearity(V)`` becomes one call, which takes the
  fused op only where the norm carries this package's pair site, the activation is exactly ``nn.SiLU`` and neither
  has hooks, else the two module calls as written). Where a modulate stands between (the timestep-conditioned
  decoders of 0.9.1+), the two run apart: the norm as `ltx_rmsnorm` (every norm keeps its class and its site), the
  modulate and the SiLU as diffusers wrote them.
- The pair and the causal convolution that reads it (``conv1``; past the identity ``dropout``, ``conv2``; each
  ``conv_out``): the rewrite of `diffusers_fastpath.models.vae_ltx2_chain` joins the pair's statement with the bare
  call ``V = self.<conv>(V)`` that ends the run after it, and the joined call runs
  `diffusers_fastpath.ops.ltx_vae_rmsnorm_conv` (the norm's multiply, cast and SiLU written straight into the
  convolution's padded channels-last input) where the convolution carries its site and nothing refuses it (hooks on
  any of the modules, a dropout in training mode: the statements as written).

``RMSNorm.forward`` is checked by source digest at patch time (a replaced or wrapped forward has no digest); where it
is not the form read here, the VAE is left as it is, with one warning. Tiling and slicing (``enable_tiling``,
``enable_slicing``) call the same modules on smaller tensors: the same sites, each checked per call by the guard.

Not fused (yet): the timestep-conditioned ``x * (1 + scale) + shift`` (and so, in those decoders, the SiLU after it).
"""

from __future__ import annotations

from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
from diffusers.models.normalization import RMSNorm
from torch import nn

from .._state import SITE_ATTR, PatchState, register_adapter
from ..ops.ltx_vae_rmsnorm import LTX_RMSNORM, LTX_VAE_RMSNORM_SILU, add_norm_class, ltx_rmsnorm, ltx_vae_rmsnorm_silu
from ..ops.ltx_vae_rmsnorm_conv import LTX_VAE_RMSNORM_CONV
from .vae import PairBlock, checked_forwards, silu_pair_unfit, swap_pair_blocks
from .vae_conv import swap_convs
from .vae_ltx2_chain import ChainPairCalls, add_chain_sites
from .vae_ltx_conv import FastpathLTXVideoCausalConv3d, swap_ltx_causal_convs
from .vae_ltx_upsampler import swap_ltx_upsamplers

# diffusers 0.42.1's RMSNorm.forward (`_source.body_digest`: the body, without docstring and formatting): the
# ``x.to(float32).pow(2).mean(-1)`` reduction, ``x * rsqrt(v + eps)`` and, without weight, ``.to(input_dtype)``
NORM_DIGESTS = frozenset({"9fb0f6c7c35813c5"})


class FastpathLTXRMSNorm(RMSNorm):
    """diffusers' ``RMSNorm`` (without weight, in LTX-Video's VAE) whose forward is `ltx_rmsnorm`
    (`diffusers_fastpath.models.vae_ltx`); ``RMSNorm.forward`` wherever the guard refuses. Adds no state."""

    def forward(self, hidden_states):
        return ltx_rmsnorm(self, hidden_states, self.__dict__.get(SITE_ATTR))


add_norm_class(FastpathLTXRMSNorm, RMSNorm)


def norm_fits() -> bool:
    """Whether ``RMSNorm.forward`` is now the form this package reads, else one warning."""
    return bool(checked_forwards([RMSNorm], NORM_DIGESTS))


PAIR_SITE = LTX_VAE_RMSNORM_SILU.name  # the pair's site, on the norm module (beside its `ltx_rmsnorm` site)
# (ltx_vae_rmsnorm_silu's: the norm as the adapter leaves it, its class swapped)
pair_unfit = silu_pair_unfit(lambda norm: type(norm) is FastpathLTXRMSNorm, "a patched LTX-Video VAE norm")
# (the pairs, each joined with the causal convolution after it, ``V = self.<conv>(V)``, where the forward's form allows:
# `vae_ltx2_chain`, LTX-Video's form: no argument names the convolution, nothing left pending)
PAIRS = ChainPairCalls("_diffusers_fastpath_vae_ltx", PAIR_SITE, pair_unfit, ltx_vae_rmsnorm_silu, moved=True,
                       chain=LTX_VAE_RMSNORM_CONV, keyword=None, bias=None, residual=None)

# Made at import, so that a pickled patched model finds the subclasses here by name.
BLOCKS = tuple(
    PairBlock(base, f"Fastpath{base.__name__}", __name__, (act,), PAIRS)
    for base, act in ((ltx.LTXVideoResnetBlock3d, "nonlinearity"), (ltx.LTXVideoEncoder3d, "conv_act"),
                      (ltx.LTXVideoDecoder3d, "conv_act"))
)


def _weightless(norm) -> bool:
    return type(norm) is RMSNorm and norm.weight is None


@register_adapter(ltx.AutoencoderKLLTXVideo)
def patch_ltx_vae(model, state: PatchState) -> None:
    """Run the VAE's weightless RMS norms as `ltx_rmsnorm`, and with the SiLU after them as `ltx_vae_rmsnorm_silu`
    (see module doc)."""
    swap_convs(model, state)  # (the causal convolutions' ``conv``: their biases)
    swap_ltx_causal_convs(model, state)  # (the causal convolutions: their padded input, channels-last)
    swap_ltx_upsamplers(model, state)  # (0.9.5's residual upsamplers: the convolution's output, the moves, the add)
    if not norm_fits():
        return
    swap_pair_blocks(model, state, BLOCKS, lambda norm, act: _weightless(norm) and type(act) is nn.SiLU)
    for module in model.modules():
        if _weightless(module):
            state.swap_class(module, FastpathLTXRMSNorm)
            state.add_site(module, LTX_RMSNORM.name)
    # (the joined norm -> SiLU -> convolution calls: a site on each convolution one names)
    add_chain_sites(model, state, {block.sub: PAIRS for block in BLOCKS if block.sub is not None},
                    lambda conv: type(conv) is FastpathLTXVideoCausalConv3d)
