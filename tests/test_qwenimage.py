"""Qwen-Image (``QwenImageTransformer2DModel``) through the shared pieces: on CPU exactness (with a padded prompt,
and the Edit-2511 per-token modulation), the fused paths' wiring (kernels emulated), the installed ``_modulate``
the fusion computes, reversibility, pickling, compilation; on the GPU the Qwen-Image config at 1024x1024."""

from __future__ import annotations


import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock, compute_text_seq_len_from_mask

import diffusers_fastpath as fp
from diffusers_fastpath import graphs
from diffusers_fastpath._state import STATE_ATTR
from diffusers_fastpath.models import qwenimage
from diffusers_fastpath._source import source_digest
from diffusers_fastpath.testing import (SimulatedGraphs, assert_compiles_fullgraph_exactly,
                                        assert_patched_equals_unpatched, assert_patched_step_exact_and_fused,
                                        assert_pipeline_generation_exact_and_fused, build_qwenimage_transformer,
                                        patch_round_trip, qwenimage_pipeline, qwenimage_prompt_embeddings,
                                        qwenimage_transformer_inputs)


def sites(blocks: int) -> dict[str, int]:
    # per attention module: rmsnorm_rope_complex (each stream's q and k on its own) and rmsnorm_rope_complex_cat (both
    # streams' q, then k, written into their joint concatenation)
    return {"layernorm_scale_shift": 4 * blocks, "gated_residual": 4 * blocks, "rmsnorm_rope_complex": blocks,
            "rmsnorm_rope_complex_cat": blocks}


CALLS = {"rmsnorm_rope_complex": 0, "rmsnorm_rope_complex_cat": 2}  # batch 1: q and k each one joint call
CALLS_BATCHED = {"rmsnorm_rope_complex": 4, "rmsnorm_rope_complex_cat": 0}  # above: the streams' slices are strided


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def test_qwenimage_is_supported_and_its_modulate_is_the_mirrored_one():
    assert "QwenImageTransformer2DModel" in fp.supported_classes()
    assert source_digest(QwenImageTransformerBlock._modulate) == qwenimage._MODULATE
    assert qwenimage._BLOCK.norms == ["img_norm1", "txt_norm1", "img_norm2", "txt_norm2"]
    assert qwenimage._BLOCK.gates == ["img_gate1", "txt_gate1", "img_gate2", "txt_gate2"]


def _mask(kind: str, gen: torch.Generator) -> torch.Tensor | None:
    valid = torch.rand(3, 9, generator=gen) < 0.6
    valid[1] = False  # a prompt with no valid token: diffusers' length is then the full sequence
    return {"none": None, "bool": valid, "long": valid.long(), "float": valid.float(),
            "last": valid | (torch.arange(9) == 8)}[kind]


@pytest.mark.parametrize("kind", ["none", "bool", "long", "float", "last"])
def test_text_seq_len_on_device_is_diffusers_function(kind):
    """The capture twin returns what diffusers' ``compute_text_seq_len_from_mask`` returns: values, dtypes, devices
    (masks with holes, a prompt without any valid token, non-bool masks)."""
    assert source_digest(compute_text_seq_len_from_mask) == qwenimage._TEXT_SEQ_LEN
    gen = torch.Generator().manual_seed(len(kind))
    states = torch.randn(3, 9, 4, generator=gen)
    mask = _mask(kind, gen)
    want, got = compute_text_seq_len_from_mask(states, mask), qwenimage.text_seq_len_on_device(states, mask)
    assert want[0] == got[0] == 9
    for w, g in zip(want[1:], got[1:]):
        assert (w is None and g is None) or (torch.equal(w, g) and w.dtype == g.dtype and w.device == g.device)
    if mask is not None:
        assert got[1].tolist()[1] == 9 and got[1].dtype == torch.long


def test_text_seq_len_on_device_raises_diffusers_error_for_a_mask_of_another_shape():
    with pytest.raises(ValueError, match="must match"):
        qwenimage.text_seq_len_on_device(torch.randn(2, 5, 4), torch.ones(2, 4, dtype=torch.bool))


class _RecordingGraphs(SimulatedGraphs):
    """`SimulatedGraphs` that notes which ``compute_text_seq_len_from_mask`` diffusers' module holds at each record."""

    def __init__(self) -> None:
        super().__init__()
        self.bound = []

    def record(self, pool, fn):
        self.bound.append(transformer_qwenimage.compute_text_seq_len_from_mask)
        return super().record(pool, fn)


def test_graphs_record_the_forward_with_the_capture_twin_bound_and_put_diffusers_function_back(unpatch_after):
    """While a graph of Qwen-Image's forward records, diffusers' module calls the twin (no host-to-device copy);
    before and after, its own function; the replayed forward equals the unpatched model."""
    model, twin = build_qwenimage_transformer(seed=3), build_qwenimage_transformer(seed=3)
    inputs = qwenimage_transformer_inputs(model, batch=2, padding=3, seed=4)
    fp.patch(model)
    unpatch_after(model)
    backend = _RecordingGraphs()
    runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", backend)
    ref = run(twin, inputs)
    first, second = run(model, inputs), run(model, inputs)
    assert backend.bound == [qwenimage.text_seq_len_on_device]
    assert transformer_qwenimage.compute_text_seq_len_from_mask is compute_text_seq_len_from_mask
    assert (runner.captures, runner.replays, len(runner.graphs)) == (1, 1, 1)
    assert torch.equal(first, ref) and torch.equal(second, ref)


def test_a_capture_twin_is_not_bound_over_a_function_someone_else_replaced(monkeypatch):
    def theirs(*args):
        return compute_text_seq_len_from_mask(*args)

    monkeypatch.setattr(transformer_qwenimage, "compute_text_seq_len_from_mask", theirs)
    with graphs.capture_twins_bound(type(build_qwenimage_transformer())):
        assert transformer_qwenimage.compute_text_seq_len_from_mask is theirs
    assert transformer_qwenimage.compute_text_seq_len_from_mask is theirs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch, padding", [(1, 0), (2, 3)], ids=["b1", "b2-padded"])
def test_patched_matches_unpatched_bitwise(dtype, batch, padding):
    assert_patched_equals_unpatched(build_qwenimage_transformer, qwenimage_transformer_inputs, sites(2), dtype,
                                    batch=batch, grid=(4, 6), txt_tokens=7, padding=padding)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels):
    model = build_qwenimage_transformer(seed=3)
    assert_patched_step_exact_and_fused(model, qwenimage_transformer_inputs(model, batch=batch, seed=4), sites(2),
                                        CALLS if batch == 1 else CALLS_BATCHED)


def test_pipeline_generation_with_cfg_is_identical_and_fused(emulated_kernels):
    """A 3-step ``QwenImagePipeline`` generation with true CFG (a padded prompt, a negative prompt of another length):
    md5-identical latents, every site of the transformer on its fast path."""
    pipe = qwenimage_pipeline(build_qwenimage_transformer(seed=12))
    assert_pipeline_generation_exact_and_fused(pipe, dict(**qwenimage_prompt_embeddings(pipe), true_cfg_scale=4.0),
                                               idle=("rmsnorm_rope_complex",))


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
            assert s.fast == CALLS.get(s.op, 1) and s.fallback == 0, s


def test_qk_norms_that_cannot_run_fused_run_as_written_and_say_why(emulated_kernels, monkeypatch, unpatch_after):
    """A forward hook on one attention's ``norm_q`` (it runs; the output is the unpatched model's with the same hook),
    or an ``apply_rotary_emb_qwen`` whose installed source this package has not checked: the norms and the rotary
    run as written and the QK norm + rotary site counts why (its partner in the joint concatenation then runs fused on
    its own)."""
    from diffusers_fastpath.models import _chain_pending

    ref, model = build_qwenimage_transformer(seed=7), build_qwenimage_transformer(seed=7)
    inputs = qwenimage_transformer_inputs(model, seed=8)
    calls = []
    for m in (ref, model):
        m.transformer_blocks[0].attn.norm_q.register_forward_hook(lambda mod, i, o: calls.append(1) or o * 2)
    expected = run(ref, inputs)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), expected) and len(calls) == 2

    def rows(block, op="rmsnorm_rope_complex"):
        return {s.site: s for s in fp.report(model).sites}[f"transformer_blocks.{block}.attn:{op}"]

    hooked, hooked_joint = rows(0), rows(0, "rmsnorm_rope_complex_cat")
    assert (hooked.fast, dict(hooked.reasons)) == (1, {"norm has hooks": 1})  # the text q, alone; the k pair joint
    assert (hooked_joint.fast, hooked_joint.fallback) == (1, 0)
    assert (rows(1).fast, rows(1).fallback, rows(1, "rmsnorm_rope_complex_cat").fast) == (0, 0, 2)
    monkeypatch.setattr(_chain_pending, "COMPLEX_ROTARIES", {})  # as if the installed function's digest differed
    assert torch.equal(run(model, inputs), expected)
    assert (rows(1).fast, dict(rows(1).reasons)) == (0, {"apply_rotary_emb_qwen is not the rotary this package checked": 4})
    assert rows(1, "rmsnorm_rope_complex_cat").fast == 2  # the first forward's


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
    LayerNorm + modulate, gated residual and QK norm + complex rotary site fused."""
    model = build_qwenimage_transformer("qwen-image", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = qwenimage_transformer_inputs(model, grid=(64, 64), txt_tokens=256, seed=9, padding=40)
        assert_patched_step_exact_and_fused(model, inputs, sites(60), CALLS)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
def test_qwen_image_generation_with_true_cfg_is_md5_identical():
    """`QwenImagePipeline` around the Qwen-Image config at 1024x1024, 2 steps with true CFG (a padded prompt of 256
    tokens, a negative of 120): the latents md5-identical to unpatched, every site fast on every forward (the
    single-stream sites idle: batch 1 writes both streams into their joint tensors)."""
    pipe = qwenimage_pipeline(build_qwenimage_transformer("qwen-image", torch.bfloat16, "cuda", seed=0))
    try:
        assert_pipeline_generation_exact_and_fused(pipe, dict(
            **qwenimage_prompt_embeddings(pipe, lengths=(256, 120), padding=40), height=1024, width=1024,
            num_inference_steps=2, true_cfg_scale=4.0), idle=("rmsnorm_rope_complex",))
    finally:
        del pipe
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_qwen_image_graphs_capture_and_replay_equal_eager(unpatch_after, fastpath_log):
    """On the GPU the forward's ``compute_text_seq_len_from_mask`` no longer stops the capture (it did: a CUDA
    tensor made from a host int in every forward): captured, replayed, equal to eager, with and without padding."""
    model = build_qwenimage_transformer(dtype=torch.bfloat16, device="cuda", seed=5)
    cases = [qwenimage_transformer_inputs(model, batch=2, padding=3, seed=s) for s in (1, 2)]
    refs = [run(model, inputs) for inputs in cases]
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    for inputs, ref in zip(cases, refs):
        assert torch.equal(run(model, inputs), ref)
    stats = fp.report(model).models[0].graphs
    assert stats["captured"] == 1 and stats["replays"] == 1 and stats["eager"] == {}, stats
    assert "could not capture" not in fastpath_log.text
