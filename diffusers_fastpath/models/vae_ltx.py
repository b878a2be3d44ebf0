"""LTX-Video's VAE (diffusers' ``AutoencoderKLLTXVideo``: LTX-Video 0.9.0 to 0.9.8, the timestep-conditioned decoders
of 0.9.1+ included), through one exact piece.

- The causal convolutions (``LTXVideoCausalConv3d``: the first frame repeated by ``repeat`` and
  ``torch.concatenate``, then the ``nn.Conv3d``) run as `diffusers_fastpath.ops.ltx_causal_conv3d`
  (`diffusers_fastpath.models.vae_ltx_conv`): the padded input written channels-last in one pass, cuDNN's
  convolution, the bias and the transpose back in one pass (checked per convolution signature). Their ``conv`` (an
  ``nn.Conv3d``) becomes `FastpathConv3d` (`diffusers_fastpath.models.vae_conv`: one vectorised pass for the bias,
  exact by construction), which the channels-first path (fp32, a refused call) runs.
- The norms: every diffusers ``RMSNorm`` of the VAE without weight (``norm1`` and ``norm2`` of each
  ``LTXVideoResnetBlock3d``, the encoder's and the decoder's ``norm_out``: each called on the channel-last view
  ``x.movedim(1, -1)`` of a channel-first activation) becomes `FastpathLTXRMSNorm`, whose forward is
  `diffusers_fastpath.ops.ltx_rmsnorm`: the fp32 squares in one pass, aten's mean and rsqrt as eager runs them, then
  the multiply and the cast in one pass (exact by construction; the first call of each dtype compared with eager). Being the module's own
  forward, it runs inside the module call, so the module's hooks and the global ones run as before. The shortcut's
  ``norm3`` (an ``nn.LayerNorm``) and everything else run as diffusers wrote them.

``RMSNorm.forward`` is checked by source digest at patch time (a replaced or wrapped forward has no digest); where it
is not the form read here, the VAE is left as it is, with one warning. Tiling and slicing (``enable_tiling``,
``enable_slicing``) call the same modules on smaller tensors: the same sites, each checked per call by the guard.

Not fused (yet): the timestep-conditioned ``x * (1 + scale) + shift`` and the SiLU after each norm (the norm is
called on ``x.movedim(1, -1)`` and moved back, not the ``V = self.norm(V)`` statement the pair rewrite of
`diffusers_fastpath.models.vae` takes, as LTX-2's VAE's is).
"""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl_ltx import AutoencoderKLLTXVideo
from diffusers.models.normalization import RMSNorm

from .._state import SITE_ATTR, PatchState, register_adapter
from ..ops.ltx_vae_rmsnorm import LTX_RMSNORM, add_norm_class, ltx_rmsnorm
from .vae import checked_forwards
from .vae_conv import swap_convs
from .vae_ltx_conv import swap_ltx_causal_convs

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


@register_adapter(AutoencoderKLLTXVideo)
def patch_ltx_vae(model, state: PatchState) -> None:
    """Run the VAE's weightless RMS norms as `ltx_rmsnorm` (see module doc)."""
    swap_convs(model, state)  # (the causal convolutions' ``conv``: their biases)
    swap_ltx_causal_convs(model, state)  # (the causal convolutions: their padded input, channels-last)
    if not norm_fits():
        return
    for module in model.modules():
        if type(module) is RMSNorm and module.weight is None:
            state.swap_class(module, FastpathLTXRMSNorm)
            state.add_site(module, LTX_RMSNORM.name)
