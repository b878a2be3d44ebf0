"""FLUX.1's rotary tables built for all axes at once (`models._pos_embed`): the same bits as diffusers' FluxPosEmbed,
on CPU and on the GPU, in fewer kernels; its constants follow the module's config and device, and leave on unpatch."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

import diffusers_fastpath as fp
from diffusers_fastpath.models import _pos_embed
from diffusers_fastpath.models._pos_embed import FastpathFluxPosEmbed
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def flux_ids(grid, txt_tokens, device, seed=0):
    """FLUX's ids as its pipelines make them (zero text ids; image ids on the latent grid, here offset at random, as
    Kontext's second image or a user's shifted grid would be)."""
    gen = torch.Generator().manual_seed(seed)
    h, w = grid
    img = torch.zeros(h, w, 3)
    img[..., 0] = torch.randint(0, 3, (1,), generator=gen).float()
    img[..., 1] = torch.arange(h)[:, None] + torch.randint(0, 50, (1,), generator=gen)
    img[..., 2] = torch.arange(w)[None, :] + torch.randint(0, 50, (1,), generator=gen)
    return torch.cat([torch.zeros(txt_tokens, 3), img.reshape(-1, 3)]).to(device)


def fused(theta=10000, axes_dim=(16, 56, 56)):
    ref = FluxPosEmbed(theta=theta, axes_dim=list(axes_dim))
    module = FluxPosEmbed(theta=theta, axes_dim=list(axes_dim))
    module.__class__ = FastpathFluxPosEmbed
    return ref, module


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grid, txt_tokens", [((64, 64), 512), ((48, 85), 77), ((32, 32), 0), ((3, 5), 7)])
def test_tables_are_diffusers_bit_for_bit(grid, txt_tokens, device):
    ref, module = fused()
    for seed in range(3):
        ids = flux_ids(grid, txt_tokens, device, seed)
        for got, want in zip(module(ids), ref(ids), strict=True):
            assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


def test_constants_follow_the_config_and_leave_with_unpatch(unpatch_after):
    ref, module = fused(axes_dim=(8, 12, 12))
    ids = flux_ids((4, 6), 3, "cpu")
    module(ids)
    key, freqs, axes = module.__dict__[_pos_embed._CONSTANTS]
    assert key == (torch.device("cpu"), 10000, (8, 12, 12)) and freqs.dtype == torch.float64
    assert freqs.shape == axes.shape == (32,) and axes.tolist() == [0] * 8 + [1] * 12 + [2] * 12
    module.theta = ref.theta = 2000  # a changed config builds its constants again
    assert all(map(torch.equal, module(ids), ref(ids)))
    assert module.__dict__[_pos_embed._CONSTANTS][0][1] == 2000
    # ids of fewer axes than the config: diffusers' forward, as written
    assert all(map(torch.equal, module(ids[:, :2]), ref(ids[:, :2])))

    model = build_flux_transformer(seed=81)
    inputs = flux_transformer_inputs(model, seed=82)
    with torch.no_grad():
        want = model(**inputs).sample
    fp.patch(model)
    unpatch_after(model)
    assert type(model.pos_embed) is FastpathFluxPosEmbed
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, want)
    fp.unpatch(model)
    assert type(model.pos_embed) is FluxPosEmbed and _pos_embed._CONSTANTS not in model.pos_embed.__dict__


def test_fewer_kernels_than_diffusers():
    """What the host issues at the start of every forward: 6 operators that compute against diffusers' 41 (the aten
    calls at the top level, views and the casts that return their input left out; the constants were built on the
    first call)."""
    from torch.profiler import ProfilerActivity, profile

    ref, module = fused()
    ids = flux_ids((64, 64), 512, "cpu")
    module(ids)

    def computing_ops(fn) -> list[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(ids)
        top = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        # a cast that returns its input (ids.float() of float32 ids, .to(ids.device)) has no child: no kernel
        return [e.name for e in top if e.name != "aten::select" and (e.name != "aten::to" or e.cpu_children)]

    mine, theirs = computing_ops(module), computing_ops(ref)
    assert mine == ["aten::index", "aten::mul", "aten::cos", "aten::to", "aten::sin", "aten::to"], mine
    assert len(theirs) == 41, theirs
