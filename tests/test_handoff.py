"""The fused update + LayerNorm-modulate between FLUX.1's blocks (`models._handoff`), on CPU with the kernels emulated:
exactness, what each site counts, and every way a hand-off is refused or goes unused, the output eager's each time."""

from __future__ import annotations

import functools
import sys

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.models import _handoff
from diffusers_fastpath.models._driver import frame_key
from diffusers_fastpath.models._handoff import (GATED_MODULATE, REASON_CHANGED, REASON_DRIVER, REASON_FP16,
                                               REASON_HOOKS, REASON_TRAINING, REASON_WASTED)
from diffusers_fastpath.models.flux import REASON_IP_ADAPTER
from diffusers_fastpath.ops.linear_cat import BATCH_REASON
from diffusers_fastpath.testing import assert_every_site_fast, build_flux_transformer, flux_transformer_inputs

ATTENTION_CALLS = {"qk_norm_rope": 2, "rotary_emb": 0}
# flux-tiny: 2 dual + 2 single blocks
TINY_SITES = {"layernorm_scale_shift": 2 * 4 + 2, "gated_residual": 2 * 4 + 2, "joint_tokens_view": 1, "gelu_cat": 2,
              "qk_norm_rope": 4, "rotary_emb": 4, "linear_cat": 2, GATED_MODULATE: 2 * 2 + 2 + 1}
HANDED = ["transformer_blocks.1.norm1:gated", "transformer_blocks.1.norm1_context:gated",
          "single_transformer_blocks.1.norm:gated"]


def run(model, inputs, **extra):
    with torch.no_grad():
        return model(**inputs, **extra).sample


def gated_sites(model) -> dict:
    return {s.site: s for s in fp.report(model).sites if s.op == GATED_MODULATE}


def patched_tiny(dtype, seed: int, unpatch_after, batch: int = 1):
    """A patched tiny FLUX, its inputs and its eager output (taken before patching)."""
    model = build_flux_transformer("flux-tiny", dtype, seed=seed)
    inputs = flux_transformer_inputs(model, batch=batch, grid=(4, 6), txt_tokens=8, seed=seed + 1)
    ref = run(model, inputs)
    assert ref.std() > 0.01  # random weights everywhere: nothing collapses to zeros
    fp.patch(model)
    unpatch_after(model)
    return model, inputs, ref


@pytest.fixture
def patched(emulated_kernels, unpatch_after):
    """`patched_tiny` in bfloat16, the kernels emulated."""
    return patched_tiny(torch.bfloat16, 61, unpatch_after)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_hand_off_runs_fused_and_the_output_is_eager(batch, emulated_kernels, unpatch_after):
    model, inputs, ref = patched_tiny(torch.bfloat16, 70 + batch, unpatch_after, batch)
    for forwards in (1, 2):
        assert torch.equal(run(model, inputs), ref)
        # every LayerNorm-modulate and gated residual counts once a forward, whichever kernel computed it
        assert_every_site_fast(fp.report(model), TINY_SITES, ATTENTION_CALLS, forwards,
                               refused={"linear_cat": BATCH_REASON} if batch > 1 else None)
    assert sorted(gated_sites(model)) == sorted(
        [f"transformer_blocks.{i}.{n}:gated" for i in range(2) for n in ("norm2", "norm2_context")] + HANDED)
    # nothing is left waiting once a forward is done
    assert all(m.__dict__.get(_handoff._PENDING) is None for m in model.modules())


def test_a_controlnet_residual_between_blocks_is_seen(patched):
    """diffusers adds ControlNet residuals to the stream between blocks: the next adaLN's hand-off is for the stream
    before it, so the adaLN normalises the new stream itself (its modulation still reused) and counts why."""
    model, inputs, _ = patched
    gen = torch.Generator().manual_seed(64)
    dual = [torch.randn(1, 24, 32, generator=gen).to(torch.bfloat16) for _ in range(2)]
    single = [torch.randn(1, 24, 32, generator=gen).to(torch.bfloat16) for _ in range(2)]
    extra = dict(controlnet_block_samples=dual, controlnet_single_block_samples=single)
    fp.unpatch(model)
    ref = run(model, inputs, **extra)
    fp.patch(model)
    assert torch.equal(run(model, inputs, **extra), ref)
    sites = gated_sites(model)
    # the image stream of the dual blocks and the single blocks' stream change; the text stream does not
    for name in ("transformer_blocks.1.norm1:gated", "single_transformer_blocks.1.norm:gated"):
        assert sites[name].fast == 1 and sites[name].reasons == {REASON_CHANGED: 1}, name
    assert sites["transformer_blocks.1.norm1_context:gated"].fast == 1
    assert sites["transformer_blocks.1.norm1_context:gated"].fallback == 0


def test_hooks_on_the_receiving_block_refuse_the_hand_off(patched):
    """Hooks on the receiving block (offloading moves its weights in them) or its adaLN: each block computes its own
    part; a pre-hook that replaces the stream is honoured."""
    model, inputs, ref = patched
    block = model.single_transformer_blocks[1]
    handle = block.register_forward_pre_hook(lambda module, args: None)
    assert torch.equal(run(model, inputs), ref)
    assert gated_sites(model)["single_transformer_blocks.1.norm:gated"].reasons == {REASON_HOOKS: 1}
    handle.remove()
    handle = model.transformer_blocks[1].norm1.linear.register_forward_hook(lambda module, args, out: out * 2)
    fp.unpatch(model)
    ref2 = run(model, inputs)
    fp.patch(model)
    assert not torch.equal(ref2, ref) and torch.equal(run(model, inputs), ref2)
    assert gated_sites(model)["transformer_blocks.1.norm1:gated"].reasons == {REASON_HOOKS: 1}
    handle.remove()


def test_float16_clipped_streams_refuse_and_inference_tensors_are_handed_off(emulated_kernels, unpatch_after):
    model, inputs, ref = patched_tiny(torch.float16, 65, unpatch_after)
    assert torch.equal(run(model, inputs), ref)
    sites = gated_sites(model)
    # diffusers clips the float16 text stream and the single blocks' stream between blocks; the image stream it does not
    assert sites["transformer_blocks.1.norm1:gated"].fast == 1
    for name in ("transformer_blocks.1.norm1_context:gated", "single_transformer_blocks.1.norm:gated"):
        assert sites[name].reasons == {REASON_FP16: 1}, name
    # an inference tensor has no version counter, but only diffusers' loop and this package's code hold the stream
    # between the blocks (the sending block's and the receiving block's hooks refuse): handed off all the same
    with torch.inference_mode():
        assert torch.equal(model(**inputs).sample, ref)
    assert gated_sites(model)["transformer_blocks.1.norm1:gated"].fast == 2
    assert gated_sites(model)["transformer_blocks.1.norm1:gated"].fallback == 0


def test_ip_adapter_output_added_after_the_update_refuses(patched, monkeypatch):
    """With an IP-Adapter the dual block adds its output to the image stream after the update: not handed off."""
    model, inputs, ref = patched
    block = model.transformer_blocks[0]
    real = block.attn.forward

    def three_outputs(*args, **kwargs):
        out, ctx = real(*args, **kwargs)
        return out, ctx, torch.zeros_like(out)  # x + 0 is x: the output stays eager's

    monkeypatch.setattr(block.attn, "forward", three_outputs)
    assert torch.equal(run(model, inputs), ref)
    assert gated_sites(model)["transformer_blocks.1.norm1:gated"].reasons == {REASON_IP_ADAPTER: 1}
    assert gated_sites(model)["transformer_blocks.1.norm1_context:gated"].fast == 1


class _Receiver(torch.nn.Module):
    """Calls `take_hand_off` for `adaln` from its forward, as the adaLN's forward does."""

    def __init__(self, adaln) -> None:
        super().__init__()
        self.adaln = adaln

    def forward(self, x, temb):
        return _handoff.take_hand_off(self.adaln, x, temb, sys._getframe())


def test_what_the_receiver_takes_is_for_those_tensors_only(patched):
    """`take_hand_off` gives the modulation only in the forward that handed it off (a module call it made), for the
    embedding it was computed from, unchanged, and the norm only for the stream it normalised, unchanged; the slot
    empties either way, and a hand-off left for another forward or another embedding counts as wasted."""
    model, *_ = patched
    adaln = model.single_transformer_blocks[1].norm
    receiver = _Receiver(adaln)
    x, temb = torch.randn(1, 4, 32), torch.randn(1, 32)
    emb, normed = torch.randn(1, 96), torch.randn(1, 4, 32)

    def driver(x_=x, temb_=temb, taken_x=None, taken_temb=None, leave=True):
        # the frame that hands off is the one that calls the receiving module
        if leave:
            adaln.__dict__[_handoff._PENDING] = _handoff._Pending(x_, temb_, emb, normed, frame_key(sys._getframe()))
        return receiver(x if taken_x is None else taken_x, temb if taken_temb is None else taken_temb)

    assert driver() == (emb, normed)
    assert driver(leave=False) == (None, None)  # taken once
    def another_forward():
        adaln.__dict__[_handoff._PENDING] = _handoff._Pending(x, temb, emb, normed, frame_key(sys._getframe()))

    another_forward()
    assert receiver(x, temb) == (None, None)  # left by a forward that has ended
    assert driver(taken_temb=torch.randn(1, 32)) == (None, None)  # another embedding

    def write_temb_then_take():
        adaln.__dict__[_handoff._PENDING] = _handoff._Pending(x, temb, emb, normed, frame_key(sys._getframe()))
        temb.add_(1)
        return receiver(x, temb)

    assert write_temb_then_take() == (None, None)  # the embedding written in place
    assert driver(taken_x=x.clone()) == (emb, None)  # another stream: its own norm

    def write_x_then_take():
        adaln.__dict__[_handoff._PENDING] = _handoff._Pending(x, temb, emb, normed, frame_key(sys._getframe()))
        x.mul_(2)
        return receiver(x, temb)

    assert write_x_then_take() == (emb, None)  # the stream written in place
    assert gated_sites(model)["single_transformer_blocks.1.norm:gated"].reasons == {REASON_CHANGED: 2,
                                                                                   REASON_WASTED: 3}


def test_a_hand_off_left_by_an_ended_forward_is_not_taken_in_the_next_one_of_its_frame_id(patched):
    """A hand-off left by a forward that ended before the receiving block took it (an exception between the two) is
    not taken by the next forward, even one that CPython runs in a frame of the same id (the same function called
    again from the same line, as a pipeline's loop calls the model) and that hands the receiver the very tensors:
    a seal names one call of the forward, not its frame's id."""
    model, *_ = patched
    adaln = model.single_transformer_blocks[1].norm
    receiver = _Receiver(adaln)
    x, temb = torch.randn(1, 4, 32), torch.randn(1, 32)
    emb, normed = torch.randn(1, 96), torch.randn(1, 4, 32)
    frames, taken = [], []

    def forward(hand_off: bool):
        frames.append(id(sys._getframe()))
        if hand_off:  # the sender's hand-off, then this forward ends
            adaln.__dict__[_handoff._PENDING] = _handoff._Pending(x, temb, emb, normed, frame_key(sys._getframe()))
            return None
        return receiver(x, temb)

    for hand_off in (True, False):
        taken.append(forward(hand_off))
    assert frames[0] == frames[1]  # the second call ran in a frame of the first one's id
    assert taken[1] == (None, None)
    assert gated_sites(model)["single_transformer_blocks.1.norm:gated"].reasons == {REASON_WASTED: 1}


def test_unpatch_removes_the_links_and_slots(patched):
    model, inputs, ref = patched
    run(model, inputs)
    fp.unpatch(model)
    assert not any(attr in m.__dict__ for m in model.modules() for attr in (_handoff._PENDING, _handoff._SENDS))
    assert torch.equal(run(model, inputs), ref)


def test_compiled_forward_takes_the_plain_path(patched):
    """A ``torch.compile`` trace hands nothing off (the receiving adaLNs compute theirs as written)."""
    model, inputs, ref = patched
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    assert torch.equal(run(compiled, inputs), ref)


# --- who calls the blocks (issue 43, items 6 and 11) --------------------------------------------------------------


class _Loop(torch.nn.Module):
    """Stands in for a block list, as cache-dit's ``CachedBlocks`` does: diffusers' loop calls this one module, whose
    forward runs the blocks itself and writes between them as its own code may (a negation through ``.data``)."""

    def __init__(self, blocks) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        for block in self.blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb,
                image_rotary_emb=image_rotary_emb, joint_attention_kwargs=joint_attention_kwargs)
            hidden_states.data.neg_()
        return encoder_hidden_states, hidden_states


class _Negate(torch.nn.Module):
    """A module put into the block list between two blocks: negates the image stream through ``.data``."""

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        hidden_states.data.neg_()
        return encoder_hidden_states, hidden_states


def _loop_over_blocks(model):
    model.transformer_blocks = torch.nn.ModuleList([_Loop(model.transformer_blocks)])


def _module_between_blocks(model):
    model.transformer_blocks.insert(1, _Negate())


@pytest.mark.parametrize("change", [_loop_over_blocks, _module_between_blocks], ids=["loop", "inserted"])
def test_blocks_called_by_anything_but_diffusers_loop_hand_nothing_off(change, emulated_kernels, unpatch_after):
    """Blocks driven by another module's loop, or a module put into the block list after `patch` between two linked
    blocks: that code runs between the sender and the receiver, and could write without a version bump (it does
    here), so nothing is handed off; the output is what the unpatched model computes with the same change."""
    seed = 81
    model = build_flux_transformer("flux-tiny", torch.bfloat16, seed=seed)
    twin = build_flux_transformer("flux-tiny", torch.bfloat16, seed=seed)
    inputs = flux_transformer_inputs(model, grid=(4, 6), txt_tokens=8, seed=seed + 1)
    fp.patch(model)
    unpatch_after(model)
    receiver = model.transformer_blocks[1]
    change(model)
    change(twin)
    ref = run(twin, inputs)
    assert torch.equal(run(model, inputs), ref)
    sites, names = gated_sites(model), {m: n for n, m in model.named_modules()}
    for adaln in (receiver.norm1, receiver.norm1_context):
        site = sites[f"{names[adaln]}:gated"]
        assert site.fast == 0 and site.reasons == {REASON_DRIVER: 1}, site.reasons
    assert sites["single_transformer_blocks.1.norm:gated"].fast == 1  # the single blocks' list is diffusers' own


def test_a_wrapper_around_the_model_forward_still_hands_off(patched):
    """A wrapper of the whole forward on the instance (accelerate's offloading hooks, cache-dit's context) runs
    before and after the loop, not between the blocks: the hand-offs are made."""
    model, inputs, ref = patched
    model.forward = functools.partial(type(model).forward, model)
    try:
        assert torch.equal(run(model, inputs), ref)
    finally:
        del model.forward
    assert all(gated_sites(model)[name].fast == 1 for name in HANDED)


def test_a_hand_off_nobody_takes_is_counted_as_wasted(patched):
    """A forward that stops between two blocks (here a ControlNet residual of the wrong size) leaves its hand-off to
    the next block untaken; the next forward's hand-off counts it, and the output is eager's."""
    model, inputs, ref = patched
    with pytest.raises(RuntimeError):
        run(model, inputs, controlnet_block_samples=[torch.zeros(1, 3, 32, dtype=torch.bfloat16)])
    assert torch.equal(run(model, inputs), ref)
    sites = gated_sites(model)
    for name in ("transformer_blocks.1.norm1:gated", "transformer_blocks.1.norm1_context:gated"):
        assert sites[name].reasons == {REASON_WASTED: 1} and sites[name].fast == 2, name


# --- random numbers (issue 43, item 8) ----------------------------------------------------------------------------


def test_training_mode_with_lora_dropout_draws_random_numbers_in_eager_order(emulated_kernels, unpatch_after):
    """In training mode (under ``no_grad``) a LoRA layer's dropout draws random numbers: the hand-off would run the
    next block's adaLN linear (and its dropout) before the rest of the sending block, so it is refused; with the same
    seed the output is eager's."""
    peft = pytest.importorskip("peft")
    model = build_flux_transformer("flux-tiny", torch.bfloat16, seed=85)
    torch.manual_seed(86)
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, init_lora_weights=False,
                                      target_modules=["linear", "to_q", "to_k", "to_v", "ff_context.net.2", "proj_out"]))
    model.train()
    inputs = flux_transformer_inputs(model, grid=(4, 6), txt_tokens=8, seed=87)

    def seeded():
        torch.manual_seed(88)
        return run(model, inputs)

    ref = seeded()
    assert not torch.equal(ref, run(model, inputs))  # dropout draws: another seed, other numbers
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(seeded(), ref)
    assert all(gated_sites(model)[name].reasons == {REASON_TRAINING: 1} for name in HANDED)
    model.eval()
    fp.unpatch(model)
    ref = run(model, inputs)
    fp.patch(model)
    assert torch.equal(run(model, inputs), ref)
    assert all(gated_sites(model)[name].fast == 1 for name in HANDED)  # eval mode: handed off again


# --- cache-dit (issue 43, item 11) --------------------------------------------------------------------------------


def _cache_dit_steps(device: str, **config):
    """A tiny FLUX (3 dual + 3 single blocks) under cache-dit's DBCache (1 front block computed, the others cached
    after one warm-up step), unpatched and patched first: ``(latents alone, latents patched, modulations computed
    alone, modulations computed patched, the patched model)``, the modulations counted in every adaLN linear."""
    cache_dit = pytest.importorskip("cache_dit")
    calls = {"n": 0}

    class CountingLinear(torch.nn.Linear):
        def forward(self, x):
            calls["n"] += 1
            return super().forward(x)

    def build():
        model = build_flux_transformer("flux-tiny", torch.bfloat16, device, seed=90, num_layers=3,
                                       num_single_layers=3, **config)
        for module in model.modules():
            if type(module).__name__.startswith("AdaLayerNormZero"):
                module.linear.__class__ = CountingLinear  # no hooks: the hand-off would call it early
        return model

    def steps(model, inputs):
        cache = cache_dit.DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=10.0,
                                        max_warmup_steps=1, num_inference_steps=4)
        cache_dit.enable_cache(model, cache_config=cache)
        calls["n"] = 0
        try:
            return [run(model, inputs) for _ in range(4)], calls["n"]
        finally:
            cache_dit.disable_cache(model)

    alone = build()
    inputs = flux_transformer_inputs(alone, grid=(4, 6), txt_tokens=8, seed=91, device=device)
    ref, ref_calls = steps(alone, inputs)
    model = build()
    fp.patch(model)
    outs, patched_calls = steps(model, inputs)
    return ref, outs, ref_calls, patched_calls, model


def test_cache_dit_skipping_blocks_leaves_no_hand_off_computed_for_nothing(emulated_kernels, unpatch_after):
    """cache-dit (DBCache) drives FLUX's blocks from its own loop and skips the middle ones on cached steps: a
    hand-off there would compute the skipped block's modulation and LayerNorm for nothing. With `patch` first, the
    modulations computed are exactly cache-dit's own (counted in every adaLN linear), none is wasted, and the latents
    are cache-dit alone's."""
    ref, outs, ref_calls, patched_calls, model = _cache_dit_steps("cpu")
    unpatch_after(model)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    assert patched_calls == ref_calls
    reasons = [s.reasons for s in gated_sites(model).values()]
    assert not any(REASON_WASTED in r for r in reasons)
    assert any(REASON_DRIVER in r for r in reasons)
    # disable_cache leaves cache-dit's own copy of FLUX's forward on the instance: still no hand-off, still exact
    assert "forward" in vars(model) and gated_sites(model)["transformer_blocks.1.norm1:gated"].fast == 0


@pytest.mark.gpu
def test_cache_dit_on_cuda_computes_no_hand_off_for_nothing(unpatch_after):
    """The same with the CUDA kernels (head dim 128, the published rotary axes: every fused kernel takes it)."""
    ref, outs, ref_calls, patched_calls, model = _cache_dit_steps(
        "cuda", attention_head_dim=128, num_attention_heads=2, axes_dims_rope=[16, 56, 56])
    unpatch_after(model)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    assert patched_calls == ref_calls
    assert not any(REASON_WASTED in s.reasons for s in gated_sites(model).values())
