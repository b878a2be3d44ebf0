"""Qwen-Image (``QwenImageTransformer2DModel``) through the shared pieces: on CPU exactness (with a padded prompt,
and the Edit-2511 per-token modulation), the fused paths' wiring (kernels emulated), the installed ``_modulate``
the fusion computes, reversibility, pickling, compilation; on the GPU the Qwen-Image config at 1024x1024."""

from __future__ import annotations


import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

import diffusers_fastpath as fp
from diffusers_fastpath.models import qwenimage
from diffusers_fastpath.models._mirror import source_digest
from diffusers_fastpath.testing import (assert_compiles_fullgraph_exactly, assert_patched_equals_unpatched,
                                        assert_patched_step_exact_and_fused, build_qwenimage_transformer,
                                        patch_round_trip, qwenimage_transformer_inputs)


def sites(blocks: int) -> dict[str, int]:
    return {"layernorm_scale_shift": 4 * blocks, "gated_residual": 4 * blocks}


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def test_qwenimage_is_supported_and_its_modulate_is_the_mirrored_one():
    assert "QwenImageTransformer2DModel" in fp.supported_classes()
    assert source_digest(QwenImageTransformerBlock._modulate) == qwenimage._MODULATE
    assert qwenimage._BLOCK.norms == ["img_norm1", "txt_norm1", "img_norm2", "txt_norm2"]
    assert qwenimage._BLOCK.gates == ["img_gate1", "txt_gate1", "img_gate2", "txt_gate2"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch, padding", [(1, 0), (2, 3)], ids=["b1", "b2-padded"])
def test_patched_matches_unpatched_bitwise(dtype, batch, padding):
    assert_patched_equals_unpatched(build_qwenimage_transformer, qwenimage_transformer_inputs, sites(2), dtype,
                                    batch=batch, grid=(4, 6), txt_tokens=7, padding=padding)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels):
    model = build_qwenimage_transformer(seed=3)
    assert_patched_step_exact_and_fused(model, qwenimage_transformer_inputs(model, batch=batch, seed=4), sites(2), {})


def test_per_token_modulation_runs_diffusers_modulate_and_says_why(emulated_kernels, unpatch_after):
    """The Edit-2511 models (``zero_cond_t``) modulate the reference image's tokens with a second timestep through a
    per-token index: the image stream's LayerNorm sites run diffusers' ``_modulate`` and count why; the text stream
    and every gated residual stay fused; the output is diffusers' to the bit."""
    model = build_qwenimage_transformer(seed=5, zero_cond_t=True)
    inputs = qwenimage_transformer_inputs(model, grid=(4, 4), edit_grids=[(2, 4)], seed=6)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), ref)
    for s in fp.report(model).sites:
        if s.op == "layernorm_scale_shift" and s.site.split(".")[-1].startswith("img_norm"):
            assert s.fast == 0 and s.reasons == {qwenimage.REASON_INDEX: 1}, s
        else:
            assert s.fast == 1 and s.fallback == 0, s


def test_unpatch_pickle_and_state_dict():
    model = build_qwenimage_transformer(seed=7)
    with patch_round_trip(model, qwenimage_transformer_inputs(model, seed=8)):
        assert type(model.transformer_blocks[0]) is qwenimage.FastpathQwenImageTransformerBlock
        assert isinstance(model.transformer_blocks[1], QwenImageTransformerBlock)
    assert type(model.transformer_blocks[0]) is QwenImageTransformerBlock


def test_compiles_with_fullgraph():
    model = build_qwenimage_transformer(seed=9)
    assert_compiles_fullgraph_exactly(model, qwenimage_transformer_inputs(model, seed=10))


@pytest.mark.gpu
@pytest.mark.full_size
def test_qwen_image_one_step_1024_is_bitwise_identical_and_fused():
    """Qwen-Image's config (38 GiB of bf16 weights), 1024x1024 with a padded prompt: bit-identical, and every
    LayerNorm + modulate and gated residual site fused."""
    model = build_qwenimage_transformer("qwen-image", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = qwenimage_transformer_inputs(model, grid=(64, 64), txt_tokens=256, seed=9, padding=40)
        assert_patched_step_exact_and_fused(model, inputs, sites(60), {})
    finally:
        del model
        torch.cuda.empty_cache()
