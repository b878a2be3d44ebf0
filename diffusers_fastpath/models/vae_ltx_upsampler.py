"""LTX-Video's and LTX-2's residual upsamplers (diffusers' ``LTXVideoUpsampler3d`` in ``AutoencoderKLLTXVideo``,
``LTX2VideoUpsampler3d`` in ``AutoencoderKLLTX2Video``): `FastpathLTXVideoUpsampler3d` /
`FastpathLTX2VideoUpsampler3d`, whose forward is `diffusers_fastpath.ops.ltx_upsampler3d`: the causal convolution's
channels-last output, its bias, the depth-to-space of it and of the input and the residual add in one pass (the values
moved and rounded as eager's; checked against the module's eager forward per convolution signature).

Only the upsamplers of the form the op takes (``stride (2, 2, 2)``, ``residual`` True, ``upscale_factor`` 2: the LTX-2
decoder's three, LTX-Video 0.9.5's) get the class and a site; the others (LTX-Video 0.9.0's, without the residual) are
left as they are. Being the modules' own forwards, these run inside the module call, so hooks on the upsampler run as
before; a hook on its ``conv`` (whose call the op stands for) refuses the op, and the forward runs as written.

The two forwards are checked by source digest at patch time, for the classes the model holds; a class whose forward
differs is left as it is, with one warning. Tiling and slicing call the same modules on smaller tensors: the same
sites, each checked per call by the guard.
"""

from __future__ import annotations

from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2
from torch import nn

from .._state import SITE_ATTR, PatchState
from ..ops.ltx_upsampler import LTX_UPSAMPLER3D, add_upsampler_class, ltx_upsampler3d
from .vae import swap_checked

# diffusers 0.42.1's forwards (`_source.body_digest`: the body, without docstring and formatting): the residual's
# reshape, permute, flatten, repeat and slice, self.conv, the result's reshape, permute, flatten and slice, the add
UPSAMPLER_DIGESTS = frozenset({"dc10a6a2836345f4",  # LTXVideoUpsampler3d.forward(hidden_states)
                               "6bf84e0cb585ef6a"})  # LTX2VideoUpsampler3d.forward(hidden_states, causal=True)


class FastpathLTXVideoUpsampler3d(ltx.LTXVideoUpsampler3d):
    """diffusers' ``LTXVideoUpsampler3d`` whose forward is `ltx_upsampler3d`
    (`diffusers_fastpath.models.vae_ltx_upsampler`); ``LTXVideoUpsampler3d.forward`` wherever the guard refuses. Adds
    no state."""

    def forward(self, hidden_states):
        return ltx_upsampler3d(self, hidden_states, None, self.__dict__.get(SITE_ATTR))


class FastpathLTX2VideoUpsampler3d(ltx2.LTX2VideoUpsampler3d):
    """diffusers' ``LTX2VideoUpsampler3d`` whose forward is `ltx_upsampler3d`
    (`diffusers_fastpath.models.vae_ltx_upsampler`); ``LTX2VideoUpsampler3d.forward`` wherever the guard refuses. Adds
    no state."""

    def forward(self, hidden_states, causal=True):
        # (diffusers' forward hands ``causal`` to its convolution, which tests ``if causal:``: a None is non-causal; the
        # op's None means LTX-Video's ``self.is_causal``)
        return ltx_upsampler3d(self, hidden_states, False if causal is None else causal,
                               self.__dict__.get(SITE_ATTR))


UPSAMPLERS = {ltx.LTXVideoUpsampler3d: FastpathLTXVideoUpsampler3d,
              ltx2.LTX2VideoUpsampler3d: FastpathLTX2VideoUpsampler3d}
for _base, _sub in UPSAMPLERS.items():
    add_upsampler_class(_sub, _base)


def _taken(module: nn.Module) -> bool:
    """Whether `module` is of the form the op takes (its guard asks again per call)."""
    return (getattr(module, "stride", None) == (2, 2, 2) and getattr(module, "residual", None) is True
            and getattr(module, "upscale_factor", None) == 2)


def swap_ltx_upsamplers(model: nn.Module, state: PatchState) -> None:
    """Make every residual ``LTXVideoUpsampler3d`` / ``LTX2VideoUpsampler3d`` of `model` of stride (2, 2, 2) and
    upscale factor 2 its `ltx_upsampler3d` subclass, with a site, where the class's forward is the one read here
    (checked for the classes `model` holds; one warning for each that is not)."""
    swap_checked(model, state, UPSAMPLERS, UPSAMPLER_DIGESTS, add_upsampler_class, LTX_UPSAMPLER3D.name, _taken)
