"""The VAEs' convolutions with a bias: their bias added by `diffusers_fastpath.ops.conv_bias` (one vectorised pass
instead of aten's broadcast add after cuDNN's convolution, exact by construction).

- Every plain ``nn.Conv2d`` / ``nn.Conv3d`` with a bias in a patched VAE (the resnets' ``conv1``, ``conv2`` and
  shortcuts, the up- and downsamplers', ``conv_in`` / ``conv_out``, LTX-Video's ``LTXVideoCausalConv3d.conv``, Wan's
  resampling ``nn.Conv2d``) becomes `FastpathConv2d` / `FastpathConv3d`, whose forward is the op: being the module's
  own forward, it runs inside the module call, so hooks run as before.
- Wan's and Qwen-Image's causal convolutions (``nn.Conv3d`` subclasses whose forward pads first) keep the forward of
  `diffusers_fastpath.models.vae_wan`; their padded input goes to the op there, with a site of its own
  (`causal_conv_site`).
"""

from __future__ import annotations

import torch
from torch import nn

from .._state import SITE_ATTR, PatchState
from ..ops.causal_conv_cl import CAUSAL_CONV3D_CL
from ..ops.conv_bias import CONV_BIAS, add_bias_conv_class, conv_bias
from ..ops.group_norm_silu_conv import takes_channels


class FastpathConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose forward is `conv_bias` (torch's forward wherever the guard refuses). Adds no state."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return conv_bias(self, input, self.__dict__.get(SITE_ATTR))


def joins_group_norm(conv: nn.Module) -> bool:
    """Whether a GroupNorm VAE's joined norm -> SiLU -> convolution call may run on `conv` (`group_norm_silu_conv`):
    a `FastpathConv2d` of input channels the op takes (`takes_channels`); the adapters give the call's site only
    there."""
    return type(conv) is FastpathConv2d and takes_channels(conv.in_channels)


class FastpathConv3d(nn.Conv3d):
    """``nn.Conv3d`` whose forward is `conv_bias` (torch's forward wherever the guard refuses). Adds no state."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return conv_bias(self, input, self.__dict__.get(SITE_ATTR))


_SUBCLASSES = {nn.Conv2d: FastpathConv2d, nn.Conv3d: FastpathConv3d}
_BASES = {sub: base for base, sub in _SUBCLASSES.items()}  # every conv_bias subclass, with the class it was
for _sub in _SUBCLASSES.values():
    add_bias_conv_class(_sub)


def add_conv_subclass(sub: type, base: type) -> None:
    """Register a family's `conv_bias` subclass `sub` of diffusers' convolution class `base` (its forward reaches
    `conv_bias`): the guard takes its modules, and `demote_unrecorded` gives any left on an unpatched model `base`."""
    add_bias_conv_class(sub)
    _BASES[sub] = base


def demote_unrecorded(model: nn.Module) -> None:
    """On unpatch, after the recorded swaps are undone: a convolution of this package's class that `patch` did not
    make (PEFT's LoRA layers built while patched copy their base layer's class: ``type(base_layer)(...)``) becomes
    torch's (or diffusers') class again, so that nothing of this package stays on an unpatched model."""
    for module in model.modules():
        base = _BASES.get(type(module))
        if base is not None:
            module.__class__ = base


def swap_convs(model: nn.Module, state: PatchState) -> None:
    """Make every plain ``nn.Conv2d`` / ``nn.Conv3d`` of `model` with a bias and zero padding (what `conv_bias` takes:
    LTX-2's decoder pads by reflection) its `conv_bias` subclass, with a site."""
    state.on_undo(demote_unrecorded, model)  # (first: undone last, after every recorded swap)
    for module in model.modules():
        sub = _SUBCLASSES.get(type(module))
        if sub is not None and module.bias is not None and module.padding_mode == "zeros":
            state.swap_class(module, sub)
            state.add_site(module, CONV_BIAS.name)


def causal_conv_site(module: nn.Module, state: PatchState) -> None:
    """Give a causal convolution (its class registered with `add_bias_conv_class`) its `conv_bias` site, and where it
    pads (its input is a new buffer) its `causal_conv3d_cl` site: the channels-last path, `conv_bias` its fallback."""
    if module.bias is not None:
        state.add_site(module, CONV_BIAS.name, CONV_BIAS.name)
        if any(module._padding):
            state.add_site(module, CAUSAL_CONV3D_CL.name, CAUSAL_CONV3D_CL.name)
