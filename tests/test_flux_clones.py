"""The FLUX-architecture families under other names (`diffusers_fastpath.models.flux_clones`: LongCat-Image,
Ovis-Image, Bria, Bria-FIBO) on CPU, and at full size on the GPU: exactness, the fused paths' wiring (kernels
emulated on CPU), reversibility, pickling, compilation."""

from __future__ import annotations

import functools

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.models import flux_clones
from diffusers_fastpath.testing import (FLUX_CLONE_CONFIGS, assert_compiles_fullgraph_exactly, assert_every_site_fast,
                                        assert_patched_equals_unpatched, assert_patched_step_exact_and_fused,
                                        build_flux_clone, flux_clone_inputs, patch_round_trip)

CLONES = sorted(FLUX_CLONE_CONFIGS)
FIBO = "BriaFiboTransformer2DModel"


def sites(dual: int, single: int, name: str) -> dict[str, int]:
    """The sites of a model of `name` with that many dual and single blocks (Ovis-Image's single block has no tanh-GELU
    MLP: no GELU + concatenation site; Bria-FIBO's single blocks normalise q and k with diffusers' RMSNorm: their QK
    norm + rotary site is `rmsnorm_rope_real`'s, not FLUX's `qk_norm_rope`)."""
    counts = {"layernorm_scale_shift": 4 * dual + single, "gated_residual": 4 * dual + single, "rotary_emb": dual + single,
              "qk_norm_rope": dual + (0 if name == FIBO else single)}
    if name == FIBO:
        counts["rmsnorm_rope_real"] = single
    if name != "OvisImageTransformer2DModel":
        counts["gelu_cat"] = single
    return counts


def calls(name: str) -> dict:
    """Fast calls per site and forward: q and k, fused with their QK norms (the plain rotary, their fallback, never
    runs)."""
    return {"qk_norm_rope": 2, "rmsnorm_rope_real": 2, "rotary_emb": 0}


def processors(model):
    return [m.processor for m in model.modules() if hasattr(m, "processor")]



@pytest.mark.parametrize("name", CLONES)
def test_supported(name):
    assert name in fp.supported_classes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", CLONES)
def test_patched_matches_unpatched_bitwise(name, dtype):
    assert_patched_equals_unpatched(functools.partial(build_flux_clone, name), flux_clone_inputs, sites(2, 2, name),
                                    dtype, batch=2, grid=(4, 6), txt_tokens=7)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", CLONES)
def test_every_site_on_the_fast_path_is_exact(name, batch, emulated_kernels):
    model = build_flux_clone(name, seed=3)
    assert_patched_step_exact_and_fused(model, flux_clone_inputs(model, batch=batch, seed=4), sites(2, 2, name), calls(name))


@pytest.mark.parametrize("name", CLONES)
def test_unpatch_pickle_and_state_dict(name):
    model = build_flux_clone(name, seed=5)
    before_processors = [type(p) for p in processors(model)]
    with patch_round_trip(model, flux_clone_inputs(model, seed=6)):
        assert processors(model) and all(type(p).__name__.startswith("Fastpath") for p in processors(model))
        assert type(model.transformer_blocks[0]).__module__ == flux_clones.__name__
    assert [type(p) for p in processors(model)] == before_processors


@pytest.mark.parametrize("name", CLONES)
def test_compiles_with_fullgraph(name):
    model = build_flux_clone(name, seed=7)
    assert_compiles_fullgraph_exactly(model, flux_clone_inputs(model, seed=8))


# --- GPU: the class defaults (FLUX.1's 19 + 38 blocks, Ovis-Image's 6 + 27), one step at 1024x1024 -----------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", CLONES)
@torch.no_grad()
def test_full_size_one_step_1024_is_bitwise_identical_and_fully_fused(name, unpatch_after):
    model = build_flux_clone(name, torch.bfloat16, "cuda", seed=0, tiny=False)
    try:
        inputs = flux_clone_inputs(model, grid=(64, 64), txt_tokens=512, seed=9)
        ref = model(**inputs).sample
        assert torch.isfinite(ref).all() and ref.std() > 0.01
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(model(**inputs).sample, ref)
        counts = sites(len(model.transformer_blocks), len(model.single_transformer_blocks), name)
        assert_every_site_fast(fp.report(model), counts, calls(name))
    finally:
        del model
        torch.cuda.empty_cache()
