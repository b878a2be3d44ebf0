"""Lumina2 (``Lumina2Transformer2DModel``, Lumina-Image 2.0) through the shared pieces: on CPU exactness (captions
of different lengths in one batch), the fused paths' wiring (kernels emulated), the unmodulated context refiner left
alone, reversibility, pickling, compilation; on the GPU the published config at 1024x1024."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention import LuminaFeedForward
from diffusers.models.normalization import LuminaRMSNormZero
from diffusers.models.transformers.transformer_lumina2 import Lumina2TransformerBlock

import diffusers_fastpath as fp
from diffusers_fastpath.models import lumina2
from diffusers_fastpath.testing import (assert_patched_equals_unpatched, assert_patched_step_exact_and_fused,
                                        assert_pipeline_generation_exact_and_fused, build_lumina2_transformer,
                                        caption_embeddings, lumina2_pipeline, lumina2_transformer_inputs,
                                        patch_round_trip)


def sites(modulated_blocks: int, context_refiner_blocks: int) -> dict[str, int]:
    """Per modulated block two RMSNorm + scale (``norm1``'s inside ``LuminaRMSNormZero``, the FFN input) and two
    RMSNorm + gated residual (the branch outputs); one SwiGLU and one QK norm + complex rotary site (q and k: two
    calls) per block, the context refiner's too."""
    return {"rmsnorm_scale": 2 * modulated_blocks, "rmsnorm_gated_residual": 2 * modulated_blocks,
            "silu_mul": modulated_blocks + context_refiner_blocks,
            "rmsnorm_rope_complex": modulated_blocks + context_refiner_blocks}


CALLS = {"rmsnorm_rope_complex": 2}  # q and k of each attention


def test_lumina2_is_supported_and_only_its_modulated_blocks_are_swapped(unpatch_after):
    assert "Lumina2Transformer2DModel" in fp.supported_classes()
    assert lumina2._NORM_ZERO.rms_scales == ["norm"]
    assert lumina2._BLOCK.rms_scales == ["ffn_norm1"] and lumina2._BLOCK.rms_gated == ["norm2", "ffn_norm2"]
    assert lumina2._FEED_FORWARD.silu_mul
    model = build_lumina2_transformer(seed=1)
    fp.patch(model)
    unpatch_after(model)
    modulated = [*model.layers, *model.noise_refiner]
    assert all(type(b) is lumina2.FastpathLumina2TransformerBlock for b in modulated)
    assert all(type(b.norm1) is lumina2.FastpathLuminaRMSNormZero for b in modulated)
    assert all(type(b) is Lumina2TransformerBlock for b in model.context_refiner)
    assert all(type(b.feed_forward) is lumina2.FastpathLuminaFeedForward for b in [*modulated, *model.context_refiner])
    fp.unpatch(model)
    assert not any(type(m).__name__.startswith("Fastpath") for m in model.modules())
    assert all(type(b.norm1) is LuminaRMSNormZero and type(b.feed_forward) is LuminaFeedForward for b in modulated)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_patched_matches_unpatched_bitwise(dtype, batch):
    assert_patched_equals_unpatched(build_lumina2_transformer, lumina2_transformer_inputs, sites(3, 1), dtype, seed=2,
                                    batch=batch, grid=(8, 6), txt_tokens=9)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels):
    model = build_lumina2_transformer(seed=4)
    assert_patched_step_exact_and_fused(model, lumina2_transformer_inputs(model, batch=batch, seed=5), sites(3, 1), CALLS)


def test_a_hooked_or_replaced_norm_runs_as_written(emulated_kernels, unpatch_after):
    """The rewritten forwards take a norm only where it is diffusers' RMSNorm without hooks: a hook on one (a LoRA
    or offloading wrapper's) makes that site refuse, counted, and run the expression as written, still exact."""
    model = build_lumina2_transformer(seed=6)
    inputs = lumina2_transformer_inputs(model, seed=7)
    seen = []
    model.layers[0].ffn_norm2.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    with torch.no_grad():
        ref = model(**inputs).sample
    fp.patch(model)
    unpatch_after(model)
    with torch.no_grad():
        got = model(**inputs).sample
    assert torch.equal(got, ref) and len(seen) == 2  # the hook ran in both forwards
    site = model.layers[0].ffn_norm2._fastpath_site_rmsnorm_gated_residual
    assert site.fast == 0 and dict(site.fallback) == {"RMSNorm has hooks": 1}  # the expression ran as written
    assert model.layers[1].ffn_norm2._fastpath_site_rmsnorm_gated_residual.fast == 1


def test_pipeline_generation_with_cfg_is_identical_and_fused(emulated_kernels):
    pipe = lumina2_pipeline(build_lumina2_transformer(seed=12))
    assert_pipeline_generation_exact_and_fused(pipe, dict(**caption_embeddings(pipe, masked=True), guidance_scale=4.0))


def test_unpatch_pickle_and_state_dict():
    model = build_lumina2_transformer(seed=8)
    with patch_round_trip(model, lumina2_transformer_inputs(model, seed=9)):
        assert type(model.layers[0]) is lumina2.FastpathLumina2TransformerBlock
    assert type(model.layers[0]) is Lumina2TransformerBlock


def test_compiles_exactly_and_each_patched_block_without_a_graph_break(unpatch_after):
    """diffusers' Lumina2 forward itself breaks the graph (its sequence lengths are read from the mask), so the
    model compiles in pieces; each patched block (its norm, gated residuals and SwiGLU) traces as one graph."""
    model = build_lumina2_transformer(seed=10)
    inputs = lumina2_transformer_inputs(model, batch=2, seed=11)
    calls = []
    handle = model.layers[0].register_forward_pre_hook(lambda m, a, kw: calls.append((a, kw)), with_kwargs=True)
    with torch.no_grad():
        ref = model(**inputs).sample
        handle.remove()
        (args, kwargs), block = calls[0], model.layers[0]
        block_ref = block(*args, **kwargs)
        fp.patch(model)
        unpatch_after(model)
        assert type(block) is lumina2.FastpathLumina2TransformerBlock
        assert torch.equal(torch.compile(block, fullgraph=True, backend="aot_eager")(*args, **kwargs), block_ref)
        assert torch.equal(torch.compile(model, backend="aot_eager")(**inputs).sample, ref)


@pytest.mark.gpu
@pytest.mark.full_size
def test_lumina2_one_step_1024_is_bitwise_identical_and_fused():
    """Lumina-Image 2.0's config (2.6B, 5 GiB of bf16 weights), 1024x1024 (a 128x128 latent, 4,096 image tokens), a
    batch of two prompts of different lengths (a CFG pair's shape): bit-identical, every site fused."""
    model = build_lumina2_transformer("lumina2", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = lumina2_transformer_inputs(model, batch=2, grid=(128, 128), txt_tokens=256, seed=12)
        assert_patched_step_exact_and_fused(model, inputs, sites(28, 2), CALLS)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
def test_lumina2_generation_with_cfg_is_md5_identical():
    """`Lumina2Pipeline` around the Lumina-Image 2.0 config at 1024x1024, 2 steps with CFG (a prompt of 256 tokens and
    a shorter negative, masked): the latents md5-identical to unpatched, every site fast on every forward."""
    pipe = lumina2_pipeline(build_lumina2_transformer("lumina2", torch.bfloat16, "cuda", seed=0))
    try:
        assert_pipeline_generation_exact_and_fused(pipe, dict(
            **caption_embeddings(pipe, lengths=(256, 90), masked=True), height=1024, width=1024,
            num_inference_steps=2, guidance_scale=4.0))
    finally:
        del pipe
        torch.cuda.empty_cache()


def test_inputs_past_the_rotary_table_are_refused_before_a_device_assert():
    """Lumina2's caption axis holds axes_lens[0] positions (300 at the published config); image tokens sit at the
    caption's length on it, so 300 tokens or more would gather past the table (a device-side assert on the GPU)."""
    model = build_lumina2_transformer(seed=0)  # the tiny config: axes_lens (64, 32, 32), 2x2 patches
    assert lumina2_transformer_inputs(model, txt_tokens=63)["encoder_hidden_states"].shape[1] == 63
    with pytest.raises(ValueError, match="max_sequence_length is 256"):
        lumina2_transformer_inputs(model, txt_tokens=64)
    with pytest.raises(ValueError, match="rotary table"):
        lumina2_transformer_inputs(model, grid=(66, 8))


def test_graphs_key_on_the_caption_lengths_and_record_without_host_reads(unpatch_after, monkeypatch):
    """CUDA graphs (simulated on the CPU): the caption lengths the forward reads on the host are part of the graph's
    signature (a second set of lengths records a second graph; the first replays for its own lengths only), and while
    a graph records, the rotary embedder gets the mask as a host copy and its tables already on the model's device."""
    from diffusers.models.transformers.transformer_lumina2 import Lumina2RotaryPosEmbed

    from diffusers_fastpath import graphs
    from diffusers_fastpath._state import STATE_ATTR
    from diffusers_fastpath.testing import SimulatedGraphs

    model, twin = build_lumina2_transformer(seed=3), build_lumina2_transformer(seed=3)
    fp.patch(model)
    unpatch_after(model)
    runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", SimulatedGraphs())
    seen = []
    original = lumina2._ROPE_FORWARD

    def spy(self, hidden_states, attention_mask):  # what the embedder is handed, outside and inside a recording
        seen.append((attention_mask.device.type, graphs.capture_side() is not None))
        return original(self, hidden_states, attention_mask)

    monkeypatch.setattr(lumina2, "_ROPE_FORWARD", spy)
    monkeypatch.setattr(Lumina2RotaryPosEmbed, "forward", spy)  # the eager forward, outside recordings
    a = lumina2_transformer_inputs(model, batch=2, seed=4)
    b = dict(a, encoder_attention_mask=a["encoder_attention_mask"].clone())
    b["encoder_attention_mask"][1, -2:] = False  # the same shapes, other lengths
    with torch.no_grad():
        for inputs in (a, b, a, b):
            assert torch.equal(model(**inputs).sample, twin(**inputs).sample)
    assert runner.captures == 2 and runner.replays == 2 and len(runner.graphs) == 2, (runner.eager, runner.failed)
    assert len({sig[2] for sig in runner.graphs}) == 2  # keyed on the two sets of caption lengths
    assert ("cpu", True) in seen  # the recording's embedder saw the host copy through the capture twin
    assert graphs.capture_side() is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_lumina2_graphs_capture_and_replay_bitwise_per_caption_lengths(dtype, unpatch_after):
    """On the GPU: a tiny Lumina2 with captions of two sets of lengths records a graph for each (no host read or
    host-to-device copy inside the capture) and replays each bit-identically to unpatched eager, for its own lengths."""
    model = build_lumina2_transformer(dtype=dtype, device="cuda", seed=5)
    a = lumina2_transformer_inputs(model, batch=2, seed=6)
    b = dict(a, encoder_attention_mask=a["encoder_attention_mask"].clone())
    b["encoder_attention_mask"][1, -2:] = False
    calls = [a, b, dict(a, hidden_states=torch.randn_like(a["hidden_states"])), b]
    with torch.no_grad():
        refs = [model(**inputs).sample for inputs in calls]
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    with torch.no_grad():
        assert all(torch.equal(model(**inputs).sample, ref) for inputs, ref in zip(calls, refs))
    stats = fp.report(model).models[0].graphs
    assert stats["status"] == "on" and stats["captured"] == 2 and stats["replays"] == 2 and not stats["eager"], stats
