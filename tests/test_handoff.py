"""The fused update + LayerNorm-modulate between FLUX.1's blocks (`models._handoff`), on CPU with the kernels emulated:
exactness, what each site counts, and every way a hand-off is refused or goes unused, the output eager's each time."""

from __future__ import annotations

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.models import _handoff
from diffusers_fastpath.models._handoff import GATED_MODULATE, REASON_CHANGED, REASON_FP16
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
    assert gated_sites(model)["single_transformer_blocks.1.norm:gated"].reasons == {
        "the receiving block has hooks": 1}
    handle.remove()
    handle = model.transformer_blocks[1].norm1.linear.register_forward_hook(lambda module, args, out: out * 2)
    fp.unpatch(model)
    ref2 = run(model, inputs)
    fp.patch(model)
    assert not torch.equal(ref2, ref) and torch.equal(run(model, inputs), ref2)
    assert gated_sites(model)["transformer_blocks.1.norm1:gated"].reasons == {"the receiving block has hooks": 1}
    handle.remove()


def test_float16_clipped_streams_and_inference_tensors_refuse(emulated_kernels, unpatch_after):
    model, inputs, ref = patched_tiny(torch.float16, 65, unpatch_after)
    assert torch.equal(run(model, inputs), ref)
    sites = gated_sites(model)
    # diffusers clips the float16 text stream and the single blocks' stream between blocks; the image stream it does not
    assert sites["transformer_blocks.1.norm1:gated"].fast == 1
    for name in ("transformer_blocks.1.norm1_context:gated", "single_transformer_blocks.1.norm:gated"):
        assert sites[name].reasons == {REASON_FP16: 1}, name
    with torch.inference_mode():  # no version counters to tell a write in place
        assert torch.equal(model(**inputs).sample, ref)
    assert gated_sites(model)["transformer_blocks.1.norm1:gated"].reasons == {"inference tensors (no version counter)": 1}


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


def test_what_the_receiver_takes_is_for_those_tensors_only(patched):
    """`take_hand_off` gives the modulation only for the embedding it was computed from, unchanged, and the norm only
    for the stream it normalised, unchanged; the slot empties either way."""
    model, *_ = patched
    adaln = model.single_transformer_blocks[1].norm
    x, temb = torch.randn(1, 4, 32), torch.randn(1, 32)
    emb, normed = torch.randn(1, 96), torch.randn(1, 4, 32)

    def leave(x_=x, temb_=temb):
        adaln.__dict__[_handoff._PENDING] = _handoff._Pending(x_, temb_, emb, normed)

    leave()
    assert _handoff.take_hand_off(adaln, x, temb) == (emb, normed)
    assert _handoff.take_hand_off(adaln, x, temb) == (None, None)  # taken once
    leave()
    assert _handoff.take_hand_off(adaln, x, torch.randn(1, 32)) == (None, None)  # another embedding
    leave()
    temb.add_(1)
    assert _handoff.take_hand_off(adaln, x, temb) == (None, None)  # the embedding written in place
    leave()
    assert _handoff.take_hand_off(adaln, x.clone(), temb) == (emb, None)  # another stream: its own norm
    leave()
    x.mul_(2)
    assert _handoff.take_hand_off(adaln, x, temb) == (emb, None)  # the stream written in place
    assert gated_sites(model)["single_transformer_blocks.1.norm:gated"].reasons == {REASON_CHANGED: 2}


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
