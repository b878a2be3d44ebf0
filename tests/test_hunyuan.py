"""HunyuanVideo (``HunyuanVideoTransformer3DModel``) and HunyuanImage-2.1 (``HunyuanImageTransformer2DModel``)
through the shared pieces: on CPU exactness (padded prompts, several latent frames), the fused paths' wiring (kernels
emulated), reversibility, pickling, compilation; on the GPU HunyuanVideo at 544x960x61 (32,640 tokens) and
HunyuanImage-2.1 at 2048x2048."""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers.models.transformers.transformer_hunyuan_video import (HunyuanVideoAttnProcessor2_0,
                                                                     HunyuanVideoSingleTransformerBlock)

import diffusers_fastpath as fp
from diffusers_fastpath.models import hunyuan
from diffusers_fastpath.testing import (assert_compiles_fullgraph_exactly, assert_patched_equals_unpatched,
                                        assert_patched_step_exact_and_fused, assert_pipeline_generation_exact_and_fused,
                                        build_hunyuan_transformer, hunyuan_transformer_inputs, hunyuan_video_pipeline,
                                        hunyuan_video_prompt_embeddings, patch_round_trip)

CONFIGS = ["hunyuan-video-tiny", "hunyuan-image-tiny"]
CALLS = {"rotary_emb": 2}  # q and k of each attention module per forward


def sites(dual: int, single: int, refiner: int) -> dict[str, int]:
    """dual blocks: norm1, norm1_context, norm2, norm2_context and four gates; single: one norm, one gate, the GELU
    + concatenation; the refiner's blocks: two gates; one rotary site per dual and single attention; the QK norms
    (diffusers' RMSNorm, the fused norm alone: their rotary takes a slice): four per dual attention, two per single."""
    return {"layernorm_scale_shift": 4 * dual + single, "gated_residual": 4 * dual + single + 2 * refiner,
            "gelu_cat": single, "rotary_emb": dual + single, "rmsnorm": 4 * dual + 2 * single}



def test_both_are_supported():
    assert {"HunyuanVideoTransformer3DModel", "HunyuanImageTransformer2DModel"} <= set(fp.supported_classes())
    refiners = [found for cls, (_, found) in {**hunyuan._VIDEO_BLOCKS, **hunyuan._IMAGE_BLOCKS}.items()
                if cls.__name__.endswith("IndividualTokenRefiner")]
    assert len(refiners) == 2 and all(f.pairwise_masks == 1 for f in refiners)  # their masks built by broadcasting


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch, padding", [(1, 0), (2, 3)], ids=["b1", "b2-padded"])
def test_patched_matches_unpatched_bitwise(config, dtype, batch, padding):
    assert_patched_equals_unpatched(functools.partial(build_hunyuan_transformer, config), hunyuan_transformer_inputs,
                                    sites(2, 2, 1), dtype, batch=batch, grid=(4, 6), txt_tokens=7, frames=2,
                                    padding=padding)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(config, batch, emulated_kernels):
    model = build_hunyuan_transformer(config, seed=3)
    inputs = hunyuan_transformer_inputs(model, batch=batch, seed=4, frames=3)
    assert_patched_step_exact_and_fused(model, inputs, sites(2, 2, 1), CALLS)


@pytest.mark.parametrize("config", CONFIGS)
def test_unpatch_pickle_and_state_dict(config):
    model = build_hunyuan_transformer(config, seed=5)
    with patch_round_trip(model, hunyuan_transformer_inputs(model, seed=6)):
        assert all(type(b).__module__ == hunyuan.__name__ for b in model.single_transformer_blocks)
        assert all(type(b.attn.processor).__module__ == hunyuan.__name__ for b in model.transformer_blocks)
        assert type(model.x_embedder).__module__ == hunyuan.__name__
    assert type(model.x_embedder).__module__ != hunyuan.__name__
    if config == "hunyuan-video-tiny":
        assert type(model.single_transformer_blocks[0]) is HunyuanVideoSingleTransformerBlock
        assert type(model.transformer_blocks[0].attn.processor) is HunyuanVideoAttnProcessor2_0


def test_pipeline_generation_with_true_cfg_is_identical(emulated_kernels):
    """`HunyuanVideoPipeline` with its embedded guidance and true CFG (a padded prompt and its negative, each its
    own forward), 3 steps over 3 latent frames: md5-identical latents, every site fast."""
    pipe = hunyuan_video_pipeline(build_hunyuan_transformer(seed=11))
    assert_pipeline_generation_exact_and_fused(pipe, dict(
        hunyuan_video_prompt_embeddings(pipe, seed=12), height=64, width=64, num_frames=9, true_cfg_scale=6.0))


@pytest.mark.parametrize("config", CONFIGS)
def test_compiles_with_fullgraph(config):
    # HunyuanImage's second text encoder merges its tokens by mask (data-dependent shapes: no full graph unpatched
    # either), so the image model compiles here without it
    model = build_hunyuan_transformer(config, seed=7, **({"text_embed_2_dim": None} if "image" in config else {}))
    assert_compiles_fullgraph_exactly(model, hunyuan_transformer_inputs(model, seed=8))


@pytest.mark.gpu
@pytest.mark.full_size
@pytest.mark.parametrize("config, grid, frames", [("hunyuan-video", (68, 120), 16), ("hunyuan-image", (64, 64), 1)],
                         ids=["video-544x960x61", "image-2048"])
def test_full_size_one_step_is_bitwise_identical_and_fused(config, grid, frames):
    """The published configs with random weights (HunyuanVideo 13B: 16 latent frames of 34x60 patches, 32,640 image
    tokens; HunyuanImage-2.1 17B at 2048x2048, 4,096 tokens), a padded prompt: bit-identical, and every site fused
    (the single blocks' image-part rotary is a contiguous view at batch 1)."""
    model = build_hunyuan_transformer(config, torch.bfloat16, "cuda", seed=0)
    try:
        inputs = hunyuan_transformer_inputs(model, grid=grid, frames=frames, txt_tokens=256, seed=9, padding=60)
        cfg = model.config
        assert_patched_step_exact_and_fused(
            model, inputs, sites(cfg.num_layers, cfg.num_single_layers, cfg.num_refiner_layers), CALLS)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
def test_full_size_video_generation_with_true_cfg_is_md5_identical():
    """`HunyuanVideoPipeline` around the published 13B config at 544x960x33 (9 latent frames of 34x60 patches:
    18,360 image tokens), 2 steps with true CFG (a 256-token prompt, 200 of them real, and its negative): the latents
    md5-identical to unpatched, every site fast."""
    pipe = hunyuan_video_pipeline(build_hunyuan_transformer("hunyuan-video", torch.bfloat16, "cuda", seed=0))
    try:
        call = hunyuan_video_prompt_embeddings(pipe, tokens=256, padding=56, seed=12)
        assert_pipeline_generation_exact_and_fused(pipe, dict(call, height=544, width=960, num_frames=33,
                                                              num_inference_steps=2, true_cfg_scale=6.0))
    finally:
        del pipe
        torch.cuda.empty_cache()
