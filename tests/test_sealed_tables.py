"""Values derived once per forward from the rotary table and shared by the layers (`models._rope_cache.derived`): kept
for the later layers only in a sealed forward (the layers called by the patched model's own diffusers forward, no
hooks anywhere below it, every processor and block known), computed in every layer otherwise; the output is the
unpatched model's bits either way (issue 43, items 5 and 6)."""

from __future__ import annotations

import inspect
import sys

import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import diffusers_fastpath as fp
from diffusers_fastpath.models import _chain_calls, _rope_cache
from diffusers_fastpath.testing import (
    build_chroma_transformer,
    build_ernie_image_transformer,
    build_hunyuan_video15_transformer,
    chroma_transformer_inputs,
    ernie_image_inputs,
    hunyuan_video15_transformer_inputs,
)

LAYERS = 3


def run(model, inputs, mode=torch.no_grad):
    with mode():
        out = model(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    return out.sample if hasattr(out, "sample") else out[0]


def ernie(unpatch_after, seed):
    model = build_ernie_image_transformer(seed=seed, num_layers=LAYERS)
    inputs = ernie_image_inputs(model, batch=2, text_lens=(9, 4), seed=seed + 1)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    return model, inputs, ref


def trig(model):
    stats = fp.report(model).models[0].caches["rotary_cos_sin"]
    return stats["built"], stats["reused"]


def test_a_sealed_forward_derives_once_also_from_inference_tensors(unpatch_after):
    """Under ``inference_mode`` the table has no version counter, and none is needed: nothing but diffusers' loop and
    this package's layers holds it. q's and k's cos/sin of every layer come from one computation per forward."""
    model, inputs, ref = ernie(unpatch_after, 31)
    assert torch.equal(run(model, inputs), ref)
    assert torch.equal(run(model, inputs, torch.inference_mode), ref)
    assert trig(model) == (2, 2 * (2 * LAYERS - 1))


def test_a_hook_anywhere_below_the_model_computes_in_every_layer(unpatch_after):
    """A hook on any module of the model (here one that never sees the table) could hold the table through its
    closure: nothing is kept, every layer computes its own; the model's own hooks run outside the loop and keep it."""
    model, inputs, ref = ernie(unpatch_after, 33)
    handle = model.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert torch.equal(run(model, inputs), ref)
    assert trig(model) == (2 * LAYERS, 0)
    handle.remove()
    handle = model.register_forward_pre_hook(lambda *args: None)
    assert torch.equal(run(model, inputs), ref)
    assert trig(model) == (2 * LAYERS + 1, 2 * LAYERS - 1)
    handle.remove()


class _Loop(torch.nn.Module):
    """Stands in for the layer list: one module whose forward runs the layers itself (a cache library's loop)."""

    def __init__(self, layers) -> None:
        super().__init__()
        self.inner = layers

    def forward(self, x, rotary_pos_emb, temb, attention_mask=None):
        for layer in self.inner:
            x = layer(x, rotary_pos_emb, temb, attention_mask)
        return x


def test_layers_called_by_another_loop_compute_in_every_layer(unpatch_after):
    model, inputs, ref = ernie(unpatch_after, 35)
    model.layers = torch.nn.ModuleList([_Loop(model.layers)])
    assert torch.equal(run(model, inputs), ref)
    assert trig(model) == (2 * LAYERS, 0)


class _WritingProcessor(FluxAttnProcessor):
    """A processor of the user's: it writes the mask it is handed in place (a version bump), then runs diffusers'."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            attention_mask.view(-1)[-1:].logical_not_()
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def test_a_foreign_processor_that_writes_the_shared_mask_product_leaves_the_later_blocks_theirs(unpatch_after):
    """Chroma's blocks each build ``mask[:, None, None, :] * mask[:, None, :, None]``; kept once per forward, a
    processor of the user's that writes the product it is handed would hand the later blocks its write. A foreign
    processor (it is handed the table and the mask) unseals the forward: each block builds its own."""
    model = build_chroma_transformer(dtype=torch.float32, seed=37)
    inputs = chroma_transformer_inputs(model, batch=1, grid=(4, 4), txt_tokens=7, seed=38, masked=2)
    model.transformer_blocks[0].attn.set_processor(_WritingProcessor())
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), ref)


def test_hunyuan_video15_pads_its_mask_once_per_sealed_forward(emulated_kernels, unpatch_after, monkeypatch):
    """HunyuanVideo-1.5's processor pads the forward's mask to the joint length and multiplies it out in every layer;
    in a sealed forward the first layer builds it and the others reuse it; with a hook on a block, every layer."""
    built = []
    real = _chain_calls.derived

    def counting(table, key, compute, *args, **kwargs):
        def counted():
            built.append(key[0])
            return compute()

        return real(table, key, counted, *args, **kwargs)

    monkeypatch.setattr(_chain_calls, "derived", counting)
    model = build_hunyuan_video15_transformer(seed=39)
    inputs = hunyuan_video15_transformer_inputs(model, seed=40, valid=5)
    layers = len(model.transformer_blocks)
    ref = run(model, inputs)
    assert layers > 1 and not built  # unpatched: diffusers' own lines
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), ref)
    assert built == ["pairwise_mask"]
    handle = model.transformer_blocks[-1].register_forward_pre_hook(lambda *args: None)
    assert torch.equal(run(model, inputs), ref)
    assert built == ["pairwise_mask"] * (1 + layers)
    handle.remove()


class _KeptTable(torch.nn.Module):
    """A rotary embedding of the user's that keeps the table it built on its first call and hands that very tensor to
    every later forward (a cache across denoising steps, which its owner refreshes through ``.data``); records the id
    of the model forward's frame that calls it."""

    def __init__(self, inner, forward_code) -> None:
        super().__init__()
        self.inner, self.forward_code, self.table, self.frames = inner, forward_code, None, []

    def forward(self, ids):
        frame = sys._getframe(1)
        while frame.f_code is not self.forward_code:
            frame = frame.f_back
        self.frames.append(id(frame))
        if self.table is None:
            self.table = self.inner(ids)
        return self.table


def test_a_table_handed_to_the_next_forward_keeps_nothing_from_the_last(unpatch_after):
    """A tensor handed to more than one forward (here the rotary table a user's cache keeps across steps; a mask the
    pipeline passes unchanged to every step) is sealed for one call of the forward, not for its frame: the next
    forward, called from the same line, runs in a frame of the same id (CPython reuses it) and must not reuse what
    the last one derived, which a write through ``.data`` between the two (no version counter moves) left stale."""
    model = build_ernie_image_transformer(seed=43, num_layers=LAYERS)
    inputs = ernie_image_inputs(model, batch=2, text_lens=(9, 4), seed=44)
    kept = _KeptTable(model.pos_embed, inspect.unwrap(type(model).forward).__code__)
    model.pos_embed = kept

    def steps():
        kept.table, outs = None, []
        for step in range(2):
            if step:
                version = kept.table._version
                kept.table.data.mul_(0.5)
                assert kept.table._version == version
            outs.append(run(model, inputs))
        return outs

    ref = steps()
    assert not torch.equal(ref[0], ref[1])  # the write changes what the second forward computes
    fp.patch(model)
    unpatch_after(model)
    got = steps()
    assert kept.frames[-1] == kept.frames[-2]  # the second forward got the first one's frame id
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1])
    # shared by the layers of the first call only; the second computes in every layer and drops the first one's
    assert trig(model) == (1 + 2 * LAYERS, 2 * LAYERS - 1)
    assert _rope_cache._DERIVED_ATTR not in kept.table.__dict__
