"""LTX-2's VAE norm as a module: diffusers' ``PerChannelRMSNorm`` (``autoencoder_kl_ltx2``: ``norm1`` / ``norm2`` of
every ``LTX2VideoResnetBlock3d``, the encoder's and the decoder's ``norm_out``) checked by source digest, and
`FastpathPerChannelRMSNorm`, its subclass whose forward is `diffusers_fastpath.ops.per_channel_rmsnorm` (see there
for the exactness argument). The VAE's adapter swaps the class and adds the sites; the pair with the SiLU after the
norm is `per_channel_rmsnorm_silu`, on the diffusers class once `norm_fits` registered it.
"""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl_ltx2 import PerChannelRMSNorm

from .._state import SITE_ATTR
from ..ops.per_channel_rmsnorm import add_norm_class, per_channel_rmsnorm
from .vae import checked_forwards

# diffusers 0.42.1's PerChannelRMSNorm.forward (`_source.body_digest`: the body, without docstring and formatting):
# ``torch.mean(x**2, dim=self.channel_dim, keepdim=True)``, ``torch.sqrt(mean_sq + self.eps)``, ``x / rms`` (its
# ``channel_dim`` argument unused but for ``channel_dim or self.channel_dim``)
NORM_DIGESTS = frozenset({"6f3cf5cceb38d1d5"})


class FastpathPerChannelRMSNorm(PerChannelRMSNorm):
    """diffusers' ``PerChannelRMSNorm`` whose forward is `per_channel_rmsnorm`
    (`diffusers_fastpath.models.vae_ltx2_norm`); ``PerChannelRMSNorm.forward`` wherever the guard refuses, and where a
    ``channel_dim`` is passed (diffusers' forward evaluates it, then reduces over ``self.channel_dim``). Adds no
    state."""

    def forward(self, x, channel_dim=None):
        if channel_dim is not None:
            return PerChannelRMSNorm.forward(self, x, channel_dim)
        return per_channel_rmsnorm(self, x, self.__dict__.get(SITE_ATTR))


add_norm_class(FastpathPerChannelRMSNorm, PerChannelRMSNorm)


def norm_fits() -> bool:
    """Whether ``PerChannelRMSNorm.forward`` is now the form this package reads (then the class is registered with
    the op, so that the pair takes diffusers' own modules too), else one warning."""
    return bool(checked_forwards([PerChannelRMSNorm], NORM_DIGESTS, register=add_norm_class))
