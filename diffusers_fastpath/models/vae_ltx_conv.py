"""LTX-Video's and LTX-2's causal 3D convolutions (diffusers' ``LTXVideoCausalConv3d`` in ``AutoencoderKLLTXVideo``,
``LTX2VideoCausalConv3d`` in ``AutoencoderKLLTX2Video``): `FastpathLTXVideoCausalConv3d` /
`FastpathLTX2VideoCausalConv3d`, whose forward is `diffusers_fastpath.ops.ltx_causal_conv3d`: the first (and last)
frame repeated around x, and for a "reflect" convolution the spatial border reflected, in one buffer written
channels-last, cuDNN's convolution on it and the bias added in the pass that transposes the result back (values moved,
never changed; the convolution checked against eager per signature), or the channels-first one buffer and the
convolution module's own call.

Being the modules' own forwards, these run inside the module call, so hooks on them run as before; the inner
``self.conv`` keeps its class as the VAE's adapter leaves it (`FastpathConv3d` with a `conv_bias` site where it swaps
the plain convolutions: the channels-first path calls it, the channels-last path adds the bias itself, its site then
counting nothing).

The two forwards are checked by source digest at patch time, for the classes the model holds; a class whose forward
differs is left as it is, with one warning. Tiling, slicing and LTX-2's temporal tiling call the same modules on smaller
tensors: the same sites, each checked per call by its guard.
"""

from __future__ import annotations

from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2
from torch import nn

from .._state import SITE_ATTR, PatchState
from ..ops.ltx_causal_conv import LTX_CAUSAL_CONV3D, add_conv_class, add_inner_conv_class, ltx_causal_conv3d
from .vae_conv import FastpathConv3d
from .vae import swap_checked

# diffusers 0.42.1's forwards (`_source.body_digest`: the body, without docstring and formatting): the first frame
# repeated k - 1 times (causal) or the first and the last (k - 1) // 2 times each, torch.concatenate, self.conv
CONV_DIGESTS = frozenset({"28aa4edeb2db1e31",  # LTXVideoCausalConv3d.forward(hidden_states): self.is_causal
                          "2b86764c5f8d5a19"})  # LTX2VideoCausalConv3d.forward(hidden_states, causal=True)


class FastpathLTXVideoCausalConv3d(ltx.LTXVideoCausalConv3d):
    """diffusers' ``LTXVideoCausalConv3d`` whose forward is `ltx_causal_conv3d`
    (`diffusers_fastpath.models.vae_ltx_conv`); ``LTXVideoCausalConv3d.forward`` wherever the guard refuses. Adds no
    state."""

    def forward(self, hidden_states):
        return ltx_causal_conv3d(self, hidden_states, None, self.__dict__.get(SITE_ATTR))


class FastpathLTX2VideoCausalConv3d(ltx2.LTX2VideoCausalConv3d):
    """diffusers' ``LTX2VideoCausalConv3d`` whose forward is `ltx_causal_conv3d`
    (`diffusers_fastpath.models.vae_ltx_conv`); ``LTX2VideoCausalConv3d.forward`` wherever the guard refuses. Adds no
    state."""

    def forward(self, hidden_states, causal=True):
        # (diffusers' forward tests ``if causal:``, so a ``None`` argument is non-causal; the op's ``None`` means
        # LTX-Video's ``self.is_causal``, and its fallback would call this forward without the argument: causal)
        return ltx_causal_conv3d(self, hidden_states, False if causal is None else causal,
                                 self.__dict__.get(SITE_ATTR))


CONVS = {ltx.LTXVideoCausalConv3d: FastpathLTXVideoCausalConv3d,
         ltx2.LTX2VideoCausalConv3d: FastpathLTX2VideoCausalConv3d}
for _base, _sub in CONVS.items():
    add_conv_class(_sub, _base)
add_inner_conv_class(FastpathConv3d)  # (``self.conv`` as `vae_conv.swap_convs` leaves it: torch's forward, bias apart)


def swap_ltx_causal_convs(model: nn.Module, state: PatchState) -> None:
    """Make every ``LTXVideoCausalConv3d`` / ``LTX2VideoCausalConv3d`` of `model` its `ltx_causal_conv3d` subclass,
    with a site, where the class's forward is the one read here (checked for the classes `model` holds; one warning
    for each that is not)."""
    swap_checked(model, state, CONVS, CONV_DIGESTS, add_conv_class, LTX_CAUSAL_CONV3D.name)
