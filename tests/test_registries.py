"""diffusers features that find blocks and processors by class or class name, on a patched model (issue 12, defects 7
and 12): regional compilation (``compile_repeated_blocks``), the caches of ``enable_cache`` (first-block cache,
MagCache, SeaCache, TaylorSeer, PAB, FasterCache), layer skipping, and the attention-backend settings a user makes
while patched. Each is ``torch.equal`` to unpatched diffusers driven the same way."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    LayerSkipConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    SeaCacheConfig,
    TaylorSeerCacheConfig,
    apply_layer_skip,
)
from diffusers.hooks._helpers import AttentionProcessorRegistry, TransformerBlockRegistry
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxTransformerBlock

import diffusers_fastpath as fp
from diffusers_fastpath import testing
from diffusers_fastpath.models import flux as flux_adapter
from diffusers_fastpath.testing import (
    outputs_equal,
    build_ernie_image_transformer,
    build_flux_transformer,
    ernie_image_inputs,
    flux_transformer_inputs,
    prompt_embeddings,
    tiny_flux_pipeline,
)


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def sample(out):
    return out.sample if hasattr(out, "sample") else out[0]


# --- diffusers' registries ---------------------------------------------------------------------------------------


def test_swapped_blocks_are_registered_like_their_base_and_diffusers_entries_stay(unpatch_after):
    fp.patch(build_flux_transformer("flux-tiny", torch.float32))
    for base, ours in (
        (FluxTransformerBlock, flux_adapter.FastpathFluxTransformerBlock),
        (flux_adapter.FluxSingleTransformerBlock, flux_adapter.FastpathFluxSingleTransformerBlock),
    ):
        theirs, mine = TransformerBlockRegistry.get(base), TransformerBlockRegistry.get(ours)
        assert mine is not theirs and theirs._cls is base and mine._cls is ours  # a copy, not diffusers' entry
        assert (mine.return_hidden_states_index, mine.return_encoder_hidden_states_index) == (
            theirs.return_hidden_states_index,
            theirs.return_encoder_hidden_states_index,
        )
    assert (
        AttentionProcessorRegistry.get(flux_adapter.FastpathFluxAttnProcessor).skip_processor_output_fn
        is AttentionProcessorRegistry.get(FluxAttnProcessor).skip_processor_output_fn
    )


# --- regional compilation ----------------------------------------------------------------------------------------


REGIONAL = {  # every family whose model lists repeated blocks: (build, make_inputs)
    "flux": (build_flux_transformer, flux_transformer_inputs),
    "ernie-image": (build_ernie_image_transformer, ernie_image_inputs),
    "chroma": (testing.build_chroma_transformer, testing.chroma_transformer_inputs),
    "flux2": (testing.build_flux2_transformer, testing.flux2_transformer_inputs),
    "qwen-image": (testing.build_qwenimage_transformer, testing.qwenimage_transformer_inputs),
    "hunyuan-video": (testing.build_hunyuan_transformer, testing.hunyuan_transformer_inputs),
    "hunyuanvideo-1.5": (testing.build_hunyuan_video15_transformer, testing.hunyuan_video15_transformer_inputs),
    "z-image": (functools.partial(testing.build_zimage_transformer, dim=256, n_heads=2, n_kv_heads=2),
                testing.zimage_transformer_inputs),
    "ltx-video": (testing.build_ltx_transformer, testing.ltx_transformer_inputs),
    "wan": (testing.build_wan_transformer, testing.wan_transformer_inputs),
}


@pytest.mark.parametrize("build, make_inputs", REGIONAL.values(), ids=REGIONAL.keys())
def test_compile_repeated_blocks_of_a_patched_model(build, make_inputs, unpatch_after):
    seed = fresh_seed()
    model, twin = build(dtype=torch.float32, seed=seed), build(dtype=torch.float32, seed=seed)
    class_names = list(type(model)._repeated_blocks)
    fp.patch(model)
    unpatch_after(model)
    assert model._repeated_blocks[: len(class_names)] == class_names  # both names: diffusers' and ours
    inputs = make_inputs(model, seed=seed + 1)
    for m in (model, twin):
        m.compile_repeated_blocks(backend="eager", fullgraph=True)
    compiled = [m for m in model.modules() if "_compiled_call_impl" in vars(m) and vars(m)["_compiled_call_impl"] is not None]
    # every swapped block of a listed class is found by its name and compiled; what stays diffusers' (a class we do
    # not swap, as Hunyuan's token refiner, or blocks left as they are, as Z-Image's unmodulated ones) is compiled too
    ours = [m for m in model.modules() if type(m).__name__.startswith("Fastpath") and type(m).__name__ in model._repeated_blocks]
    assert ours and all(any(m is c for c in compiled) for m in ours)
    assert len(compiled) == sum(vars(m).get("_compiled_call_impl") is not None for m in twin.modules())  # as many
    with torch.no_grad():
        assert outputs_equal(sample(model(**inputs)), sample(twin(**inputs)))
    fp.unpatch(model)
    assert "_repeated_blocks" not in vars(model) and model._repeated_blocks == class_names


def test_compile_repeated_blocks_fullgraph_over_three_resolutions(unpatch_after):
    """torch.compile keeps its cache and its recompile limit (8) per code object: the patched classes' forward
    wrappers (`_state.bound_safe`) each have their own, as diffusers' classes do, or FLUX's dual and single blocks at
    each shape spent one budget and ``fullgraph=True`` failed at a third resolution the unpatched model runs."""
    model, twin = build_flux_transformer("flux-tiny", torch.bfloat16, seed=21), build_flux_transformer(
        "flux-tiny", torch.bfloat16, seed=21)
    fp.patch(model)
    unpatch_after(model)
    for m in (model, twin):
        m.compile_repeated_blocks(backend="eager", fullgraph=True)
    with torch.no_grad():
        for i, (batch, grid) in enumerate([(1, (4, 4)), (2, (4, 6)), (1, (6, 6))]):
            inputs = flux_transformer_inputs(model, batch=batch, grid=grid, seed=i)
            assert outputs_equal(sample(model(**inputs)), sample(twin(**inputs)))
    torch._dynamo.reset()


# --- caches and layer skip ---------------------------------------------------------------------------------------

def _timestep(pipe):
    return lambda: pipe._current_timestep if pipe._current_timestep is not None else 1000


# Each config as a function of the pipeline whose denoising it follows (PAB and FasterCache read the timestep).
CACHES = {
    "first_block": lambda pipe: FirstBlockCacheConfig(threshold=0.3),
    "mag": lambda pipe: MagCacheConfig(threshold=0.5, num_inference_steps=4, mag_ratios=[1.0, 1.0, 0.98, 0.97]),
    "sea": lambda pipe: SeaCacheConfig(),
    "taylorseer": lambda pipe: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
    "pab": lambda pipe: PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=_timestep(pipe),
    ),
    "faster": lambda pipe: FasterCacheConfig(
        spatial_attention_block_skip_range=2, current_timestep_callback=_timestep(pipe), is_guidance_distilled=True
    ),
}


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_enable_cache_on_a_patched_flux_pipeline(cache, unpatch_after):
    """Four denoising steps of a tiny FluxPipeline (the pipeline drives ``cache_context``), patched and unpatched,
    each with the same cache config: the latents are ``torch.equal``."""
    seed = fresh_seed()
    latents = []
    for patched in (False, True):
        pipe = tiny_flux_pipeline(dtype=torch.float32, seed=seed)
        if patched:
            fp.patch(pipe)
            unpatch_after(pipe)
        pipe.transformer.enable_cache(CACHES[cache](pipe))
        out = pipe(
            **prompt_embeddings(pipe, seed=seed + 1), num_inference_steps=4, height=32, width=32,
            output_type="latent", generator=torch.Generator().manual_seed(seed),
        ).images
        latents.append(out)
    assert torch.equal(latents[0], latents[1])
    assert fp.report(pipe).fast + fp.report(pipe).fallback > 0  # the patched blocks ran under the cache


@pytest.mark.parametrize(
    "config",
    [
        dict(indices=[0], fqn="transformer_blocks", skip_attention=True, skip_ff=True),
        dict(indices=[1], fqn="single_transformer_blocks", skip_attention=True, skip_ff=True),
        dict(indices=[0], fqn="transformer_blocks", skip_attention=False, skip_ff=True),
    ],
    ids=["dual-block", "single-block", "ff"],
)
def test_apply_layer_skip_on_a_patched_flux(config, unpatch_after):
    """What SkipLayerGuidance applies to the transformer: the skipped layers run as in unpatched diffusers. (Skipping
    attention alone, or its scores, raises in diffusers 0.42.1 for FLUX unpatched too: ``FluxAttention`` has no
    ``is_cross_attention``.)"""
    seed = fresh_seed()
    model, twin = (build_flux_transformer("flux-tiny", torch.float32, seed=seed) for _ in range(2))
    fp.patch(model)
    unpatch_after(model)
    for m in (model, twin):
        apply_layer_skip(m, LayerSkipConfig(**copy.deepcopy(config)))
    with torch.no_grad():
        for step in range(2):
            inputs = flux_transformer_inputs(model, seed=seed + 1 + step)
            assert torch.equal(model(**inputs).sample, twin(**inputs).sample)


# --- attention-backend settings made while patched -----------------------------------------------------------------


def processors(model):
    return [m.processor for m in model.modules() if hasattr(m, "processor")]


@pytest.fixture(autouse=True)
def _keep_the_active_attention_backend():
    """``set_attention_backend`` also sets diffusers' process-wide active backend: put it back for later tests."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


@pytest.mark.parametrize("build", [build_flux_transformer, build_ernie_image_transformer], ids=["flux", "ernie-image"])
def test_set_attention_backend_while_patched_survives_unpatch(build):
    model = build(dtype=torch.float32, seed=fresh_seed())
    before = processors(model)
    assert all("_attention_backend" not in vars(p) for p in before)
    fp.patch(model)
    model.set_attention_backend("_native_math")
    fp.unpatch(model)
    after = processors(model)
    assert [type(p) for p in after] == [type(p) for p in before] and all(a is b for a, b in zip(after, before))
    assert all(vars(p).get("_attention_backend") == "_native_math" for p in after)


@pytest.mark.parametrize("build", [build_flux_transformer, build_ernie_image_transformer], ids=["flux", "ernie-image"])
def test_reset_attention_backend_while_patched_survives_unpatch(build):
    model = build(dtype=torch.float32, seed=fresh_seed())
    model.set_attention_backend("_native_math")
    fp.patch(model)
    assert all(vars(p).get("_attention_backend") == "_native_math" for p in processors(model))  # carried on patch
    model.reset_attention_backend()
    fp.unpatch(model)
    assert all(p._attention_backend is None for p in processors(model))
    assert all(type(p).__module__.startswith("diffusers.") for p in processors(model))


def test_an_absent_backend_setting_stays_absent_and_a_parallel_config_is_carried():
    model = build_flux_transformer("flux-tiny", torch.float32, seed=fresh_seed())
    model.set_attention_backend("_native_math")
    fp.patch(model)
    marker = object()
    for p in processors(model):  # what a user (or context parallelism) sets on the patched processors
        del p._attention_backend
        p._parallel_config = marker
    fp.unpatch(model)
    assert all("_attention_backend" not in vars(p) and p._parallel_config is marker for p in processors(model))
