"""Z-Image (``ZImageTransformer2DModel``) through the shared pieces: on CPU exactness (captions of different
lengths in one batch), the fused paths' wiring (kernels emulated), the unmodulated context refiner left alone,
reversibility, pickling, compilation; on the GPU the Z-Image config at 1024x1024."""

from __future__ import annotations


import pytest
import torch
from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

import diffusers_fastpath as fp
from diffusers_fastpath.models import zimage
from diffusers_fastpath.testing import (assert_compiles_fullgraph_exactly, assert_patched_equals_unpatched,
                                        assert_patched_step_exact_and_fused, assert_pipeline_generation_exact_and_fused,
                                        build_zimage_transformer, caption_embeddings, patch_round_trip, zimage_pipeline,
                                        zimage_transformer_inputs)


def sites(modulated_blocks: int, context_refiner_blocks: int) -> dict[str, int]:
    """Per modulated block two RMSNorm + scale (the branch inputs) and two RMSNorm + gated residual (the branch
    outputs); one SwiGLU and one QK norm + complex rotary (q and k: two calls) per block, the context refiner's
    (unmodulated) too."""
    return {"rmsnorm_scale": 2 * modulated_blocks, "rmsnorm_gated_residual": 2 * modulated_blocks,
            "silu_mul": modulated_blocks + context_refiner_blocks,
            "rmsnorm_rope_complex": modulated_blocks + context_refiner_blocks}


CALLS = {"rmsnorm_rope_complex": 2}



def test_zimage_is_supported_and_only_its_modulated_blocks_are_swapped(unpatch_after):
    assert "ZImageTransformer2DModel" in fp.supported_classes()
    assert zimage._BLOCK.rms_scales == ["attention_norm1", "ffn_norm1"]
    assert zimage._BLOCK.rms_gated == ["attention_norm2", "ffn_norm2"] and not zimage._BLOCK.gates
    model = build_zimage_transformer(seed=1)
    fp.patch(model)
    unpatch_after(model)
    assert all(type(b) is zimage.FastpathZImageTransformerBlock for b in [*model.layers, *model.noise_refiner])
    assert all(type(b) is ZImageTransformerBlock for b in model.context_refiner)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_patched_matches_unpatched_bitwise(dtype, batch):
    assert_patched_equals_unpatched(build_zimage_transformer, zimage_transformer_inputs, sites(3, 1), dtype, seed=2,
                                    batch=batch, grid=(8, 6), txt_tokens=9)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels):
    model = build_zimage_transformer(seed=4)
    assert_patched_step_exact_and_fused(model, zimage_transformer_inputs(model, batch=batch, seed=5), sites(3, 1), CALLS)


def test_pipeline_generation_with_cfg_is_identical_and_fused(emulated_kernels):
    pipe = zimage_pipeline(build_zimage_transformer(seed=12))
    assert_pipeline_generation_exact_and_fused(pipe, dict(**caption_embeddings(pipe), guidance_scale=4.0))


def test_attention_is_rewritten_only_where_its_local_rotary_is_the_known_one():
    """The processor's QK norms wait for its local ``apply_rotary_emb`` only when that function's source has the
    digest the adapter knows; with another (a changed diffusers), nothing in the processor is rewritten."""
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    from diffusers_fastpath.models._chains import fused_subclass

    assert zimage.FastpathZSingleStreamAttnProcessor._fastpath_rewrite.rotary_complex == 2
    assert zimage.FastpathZSingleStreamAttnProcessor._fastpath_rewrite.qk_norms == ["norm_q", "norm_k"]
    other = fused_subclass(ZSingleStreamAttnProcessor, "Other", __name__, "__call__",
                           local_rotary=("apply_rotary_emb", "0" * 16))
    assert other == (None, None)


def test_unpatch_pickle_and_state_dict():
    model = build_zimage_transformer(seed=6)
    with patch_round_trip(model, zimage_transformer_inputs(model, seed=7)):
        assert type(model.layers[0]) is zimage.FastpathZImageTransformerBlock
    assert type(model.layers[0]) is ZImageTransformerBlock


def test_compiles_with_fullgraph():
    model = build_zimage_transformer(seed=8)
    assert_compiles_fullgraph_exactly(model, zimage_transformer_inputs(model, seed=9))


@pytest.mark.gpu
@pytest.mark.full_size
def test_z_image_one_step_1024_is_bitwise_identical_and_fused():
    """Z-Image's config (6B, 12 GiB of bf16 weights), 1024x1024 (a 128x128 latent, 4,096 image tokens), a batch of
    two prompts of different lengths: bit-identical, every sandwich norm and SwiGLU fused."""
    model = build_zimage_transformer("z-image", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = zimage_transformer_inputs(model, batch=2, grid=(128, 128), txt_tokens=128, seed=10)
        assert_patched_step_exact_and_fused(model, inputs, sites(32, 2), CALLS)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
def test_z_image_generation_with_cfg_is_md5_identical():
    """`ZImagePipeline` around the Z-Image config at 1024x1024, 2 steps with CFG (a prompt of 128 tokens and a
    shorter negative): the latents md5-identical to unpatched, every site fast on every forward."""
    pipe = zimage_pipeline(build_zimage_transformer("z-image", torch.bfloat16, "cuda", seed=0))
    try:
        assert_pipeline_generation_exact_and_fused(pipe, dict(**caption_embeddings(pipe, lengths=(128, 40)),
                                                              height=1024, width=1024, num_inference_steps=2,
                                                              guidance_scale=4.0))
    finally:
        del pipe
        torch.cuda.empty_cache()
