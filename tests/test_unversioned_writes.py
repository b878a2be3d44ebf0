"""Writes no version counter sees (issue 43, items 5 and 6), made by a hook between two blocks, against everything this
package computes in one block and uses in a later one: FLUX.1's hand-off of a stream to the next block's adaLN
(`models._handoff`), the values derived from the forward's rotary table (`models._rope_cache.derived`: ERNIE-Image's
cos/sin, Chroma's mask product), and the timestep embedding whose SiLU was once shared by every block (dropped: it
saved ~76 kernels of [B, 3072] a FLUX.1 step). Each write is made the same way on the unpatched model, which is the
reference; the patched model must give its bits exactly, under ``no_grad`` and under ``inference_mode``."""

from __future__ import annotations

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.models._handoff import REASON_HOOKS
from diffusers_fastpath.quality import hooked
from diffusers_fastpath.testing import (
    build_chroma_transformer,
    build_ernie_image_transformer,
    build_flux_transformer,
    build_qwenimage_transformer,
    build_sd3_transformer,
    chroma_transformer_inputs,
    ernie_image_inputs,
    flux_transformer_inputs,
    qwenimage_transformer_inputs,
    sd3_transformer_inputs,
)

# --- the writes ---------------------------------------------------------------------------------------------------


def _change(t: torch.Tensor) -> None:
    """The change every write makes, in place: a float tensor negated, a boolean mask's last element flipped."""
    if t.dtype == torch.bool:
        t.view(-1)[-1:].logical_not_()
    else:
        t.neg_()


def _through_storage(t: torch.Tensor) -> None:
    whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).clone()
    _change(whole.as_strided(t.size(), t.stride(), t.storage_offset()))
    t.untyped_storage().copy_(whole.untyped_storage())


def _through_numpy(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.numpy().reshape(-1)[-1] ^= True
    else:  # the same bits as integers: flipping the sign bit negates
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        t.view(bits).numpy()[...] ^= torch.iinfo(bits).min


def _through_alias(t: torch.Tensor) -> None:
    _change(torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride()))


WRITES = {  # name: (write, autograd mode the forward runs in)
    "data": (lambda t: _change(t.data), torch.no_grad),
    "set_": (_through_alias, torch.no_grad),
    "untyped_storage": (_through_storage, torch.no_grad),
    "dlpack": (lambda t: _change(torch.from_dlpack(t)), torch.no_grad),
    "numpy": (_through_numpy, torch.no_grad),
    "inference": (_change, torch.inference_mode),  # an inference tensor has no version counter at all
}


def write(how: str, t: torch.Tensor) -> None:
    version = None if t.is_inference() else t._version
    WRITES[how][0](t)
    assert version is None or t._version == version  # the write is one no version counter sees


# --- where the hooks write ----------------------------------------------------------------------------------------


def _arg(args, kwargs, name, index):
    return kwargs[name] if name in kwargs else args[index]


def after_block(blocks_attr, index, pick):
    """A forward hook on ``model.<blocks_attr>[index]`` that writes ``pick(args, kwargs, output)``."""

    def install(model, how):
        def hook(module, args, kwargs, output):
            write(how, pick(args, kwargs, output))

        return getattr(model, blocks_attr)[index].register_forward_hook(hook, with_kwargs=True)

    return install


def before_block(blocks_attr, index, pick):
    """A forward pre-hook on ``model.<blocks_attr>[index]`` that writes ``pick(args, kwargs)``."""

    def install(model, how):
        def hook(module, args, kwargs):
            write(how, pick(args, kwargs))

        return getattr(model, blocks_attr)[index].register_forward_pre_hook(hook, with_kwargs=True)

    return install


CASES = {
    # FLUX.1's hand-off: the stream written after the sending block (a hook on the sending block was never checked)
    "flux-image-stream": (build_flux_transformer, flux_transformer_inputs,
                          after_block("transformer_blocks", 0, lambda a, k, out: out[1])),
    "flux-single-stream": (build_flux_transformer, flux_transformer_inputs,
                           after_block("single_transformer_blocks", 0, lambda a, k, out: out[1])),
    # the timestep embedding: FLUX.1's hand-off computes the next adaLN's modulation from it early; the shared SiLU
    # (FLUX.1, SD3, Qwen-Image) kept its SiLU on it
    "flux-temb": (build_flux_transformer, flux_transformer_inputs,
                  after_block("transformer_blocks", 0, lambda a, k, out: _arg(a, k, "temb", 2))),
    "sd3-temb": (build_sd3_transformer, sd3_transformer_inputs,
                 after_block("transformer_blocks", 0, lambda a, k, out: _arg(a, k, "temb", 2))),
    "qwen-image-temb": (build_qwenimage_transformer, qwenimage_transformer_inputs,
                        after_block("transformer_blocks", 0, lambda a, k, out: _arg(a, k, "temb", 3))),
    # ERNIE-Image's rotary table, whose cos/sin every layer reads
    "ernie-image-table": (build_ernie_image_transformer, ernie_image_inputs,
                          before_block("layers", 1, lambda a, k: _arg(a, k, "rotary_pos_emb", 1))),
    # Chroma's attention mask, whose outer product every block builds
    "chroma-mask": (build_chroma_transformer, lambda m, seed: chroma_transformer_inputs(m, seed=seed, masked=3),
                    before_block("transformer_blocks", 1, lambda a, k: _arg(a, k, "attention_mask", 4))),
}


def run(model, inputs, mode):
    """The model's output on a copy of `inputs` (a hook may write an input in place, the mask)."""
    with mode():
        out = model(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    return (out.sample if hasattr(out, "sample") else out[0]).clone()


@pytest.mark.parametrize("how", sorted(WRITES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_write_no_version_counter_sees_between_two_blocks_is_seen(case, how, emulated_kernels, unpatch_after):
    build, make_inputs, install = CASES[case]
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = build(dtype=torch.float32 if how == "numpy" else torch.bfloat16, seed=seed)  # NumPy has no bfloat16
    inputs = make_inputs(model, seed=seed + 1)
    mode = WRITES[how][1]
    plain = run(model, inputs, mode)
    handle = install(model, how)
    ref = run(model, inputs, mode)
    assert not torch.equal(ref, plain)  # the write changes what the later blocks compute
    fp.patch(model)
    unpatch_after(model)
    for _ in range(2):
        assert torch.equal(run(model, inputs, mode), ref)
    handle.remove()
    assert torch.equal(run(model, inputs, mode), plain)
    if case.startswith("flux") and "stream" in case:  # the sending block's hook refuses the hand-off, says why
        refused = [s for s in fp.report(model).sites if REASON_HOOKS in s.reasons]
        assert refused and all(s.reasons[REASON_HOOKS] == 2 for s in refused)


def _hooked_sees_global_hooks() -> bool:
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        return hooked(torch.nn.Identity())
    finally:
        handle.remove()


@pytest.mark.skipif(not _hooked_sees_global_hooks(),
                    reason="needs quality.hooked to see global module hooks (issue 43 item 2)")
@pytest.mark.parametrize("case", ["flux-image-stream", "ernie-image-table"])
def test_a_global_module_hook_that_writes_is_seen(case, emulated_kernels, unpatch_after):
    """The same writes from global hooks (torch's ``register_module_forward_hook``/``..._pre_hook``, which run for
    every module; these write at one block only): FLUX.1's image stream after its first dual block, ERNIE-Image's
    rotary table before its second layer (called with positional arguments, which a global pre-hook sees)."""
    build, make_inputs, _ = CASES[case]
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model = build(dtype=torch.bfloat16, seed=seed)
    inputs = make_inputs(model, seed=seed + 1)
    plain = run(model, inputs, torch.no_grad)
    if case == "flux-image-stream":
        block = model.transformer_blocks[0]
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: write("data", out[1]) if module is block else None)
    else:
        block = model.layers[1]
        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: write("data", args[1]) if module is block else None)
    try:
        ref = run(model, inputs, torch.no_grad)
        assert not torch.equal(ref, plain)
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(run(model, inputs, torch.no_grad), ref)
    finally:
        handle.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["data", "inference"])
@pytest.mark.parametrize("case", ["flux-image-stream", "flux-temb", "ernie-image-table"])
def test_a_write_no_version_counter_sees_is_seen_with_the_cuda_kernels(case, how, unpatch_after):
    """The same with the CUDA kernels (FLUX.1 at head dim 128 and the published rotary axes, which every fused
    kernel takes), the fused hand-off and the kept cos/sin on the GPU."""
    build, make_inputs, install = CASES[case]
    extra = dict(attention_head_dim=128, num_attention_heads=2, axes_dims_rope=[16, 56, 56]) if "flux" in case else {}
    model = build(dtype=torch.bfloat16, device="cuda", seed=41, **extra)
    inputs = make_inputs(model, seed=42)
    mode = WRITES[how][1]
    plain = run(model, inputs, mode)
    handle = install(model, how)
    ref = run(model, inputs, mode)
    assert not torch.equal(ref, plain)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs, mode), ref)
    handle.remove()
    assert torch.equal(run(model, inputs, mode), plain)
    if "flux" in case:  # without the hook the hand-offs run fused
        assert any(s.op == "gated_layernorm_scale_shift" and s.fast for s in fp.report(model).sites)
