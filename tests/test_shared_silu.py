"""The adaLN SiLU of the timestep embedding, once per forward (`models._shared_silu`): the same bits as each block's
own SiLU, computed once per input tensor, recomputed after any write in place, and left as written wherever sharing
could change a number (autograd, inference tensors, hooks)."""

from __future__ import annotations

import torch
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath._state import PatchState
from diffusers_fastpath.models._shared_silu import FastpathSharedSiLU, share_silu
from diffusers_fastpath.testing import build_flux_transformer, build_qwenimage_transformer, flux_transformer_inputs


def shared(n: int = 3):
    state = PatchState("lossless")
    modules = [nn.SiLU() for _ in range(n)]
    assert all(share_silu(state, m) for m in modules)
    return state, modules


def test_one_computation_per_input_tensor_with_the_same_bits():
    state, modules = shared()
    temb = torch.randn(2, 64).to(torch.bfloat16)
    with torch.no_grad():
        outs = [m(temb) for m in modules]
    assert all(o is outs[0] for o in outs) and torch.equal(outs[0], torch.nn.functional.silu(temb))
    assert (state.shared_silu_stats.built, state.shared_silu_stats.reused) == (1, 2)
    with torch.no_grad():
        other = torch.randn(2, 64).to(torch.bfloat16)
        assert modules[0](other) is not outs[0] and torch.equal(modules[1](other), torch.nn.functional.silu(other))


def test_a_write_in_place_to_the_input_or_the_result_computes_again():
    state, modules = shared()
    temb = torch.randn(4, 8)
    with torch.no_grad():
        first = modules[0](temb)
        temb.mul_(2)  # the embedding written in place: the stored SiLU is of the old values
        second = modules[1](temb)
        assert torch.equal(second, torch.nn.functional.silu(temb)) and second is not first
        second.add_(1)  # a consumer writing into its input: the next block must not see it
        assert torch.equal(modules[2](temb), torch.nn.functional.silu(temb))
    assert state.shared_silu_stats.built == 3


def test_autograd_inference_tensors_and_hooks_compute_as_written():
    state, modules = shared()
    temb = torch.randn(2, 8, requires_grad=True)
    assert modules[0](temb) is not modules[1](temb)  # shared, its gradients would accumulate in another order
    with torch.inference_mode():
        frozen = torch.randn(2, 8)
        assert modules[0](frozen) is not modules[1](frozen)  # no version counter to see a write in place
    seen = []
    modules[2].register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        x = torch.randn(2, 8)
        assert modules[0](x) is modules[1](x) and modules[2](x) is not modules[0](x) and seen
    assert state.shared_silu_stats.built == 1  # only the plain calls above stored anything


def test_only_plain_silus_are_swapped():
    state = PatchState("lossless")
    assert not share_silu(state, nn.SiLU(inplace=True)) and not share_silu(state, nn.GELU())
    assert not share_silu(state, None)


def test_flux_adaln_silus_share_one_computation_per_forward_and_unpatch(unpatch_after):
    model = build_flux_transformer(seed=3)
    inputs = flux_transformer_inputs(model, seed=4)
    with torch.no_grad():
        ref = model(**inputs).sample
    fp.patch(model)
    unpatch_after(model)
    silus = [m for m in model.modules() if type(m) is FastpathSharedSiLU]
    blocks = len(model.transformer_blocks) * 2 + len(model.single_transformer_blocks)
    assert len(silus) == blocks
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, ref)
    assert fp.report(model).models[0].caches["timestep_silu"] == {"built": 1, "reused": blocks - 1}
    fp.unpatch(model)
    assert not any(type(m) is FastpathSharedSiLU for m in model.modules())


def test_qwenimage_modulations_share_their_silu(unpatch_after):
    model = build_qwenimage_transformer(seed=5)
    fp.patch(model)
    unpatch_after(model)
    assert all(type(b.img_mod[0]) is FastpathSharedSiLU and type(b.txt_mod[0]) is FastpathSharedSiLU
               for b in model.transformer_blocks)
