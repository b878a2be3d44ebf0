"""Chroma (``ChromaTransformer2DModel``) on CPU: exactness with and without the attention mask, the fused paths'
wiring (kernels emulated), pipelines with guidance, state dicts, reversibility, pickling, the report."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from diffusers.models.transformers.transformer_chroma import (ChromaCombinedTimestepTextProjEmbeddings,
                                                              ChromaSingleTransformerBlock, ChromaTransformerBlock)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import diffusers_fastpath as fp
from diffusers_fastpath.models import chroma
from diffusers_fastpath.testing import (assert_compiles_fullgraph_exactly, build_chroma_transformer,
                                        chroma_prompt_embeddings, chroma_transformer_inputs, patch_round_trip,
                                        tiny_chroma_pipeline)

# the tiny config: 2 dual + 2 single blocks
TINY_SITES = {"layernorm_scale_shift": 2 * 4 + 2, "gated_residual": 2 * 4 + 2, "gelu_cat": 2, "qk_norm_rope": 4,
              "rotary_emb": 4, "linear_cat": 2}


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def test_chroma_is_supported():
    assert "ChromaTransformer2DModel" in fp.supported_classes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch,masked", [(1, 0), (2, 3)], ids=["b1", "b2-masked"])
def test_patched_transformer_matches_unpatched_bitwise(dtype, batch, masked, unpatch_after):
    ref_model = build_chroma_transformer(dtype=dtype, seed=3)
    model = build_chroma_transformer(dtype=dtype, seed=3)
    inputs = chroma_transformer_inputs(model, batch=batch, grid=(4, 6), txt_tokens=7, seed=4, masked=masked)
    ref = run(ref_model, inputs)
    assert torch.isfinite(ref).all() and ref.std() > 0.1
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), ref)
    assert collections.Counter(s.op for s in fp.report(model).sites) == TINY_SITES


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels, unpatch_after):
    """The fused paths' wiring on CPU (kernels emulated, see conftest): every site fast once, the output still
    bit-identical."""
    model = build_chroma_transformer(seed=5)
    inputs = chroma_transformer_inputs(model, batch=batch, grid=(4, 4), txt_tokens=6, seed=6, masked=batch - 1)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), ref)
    sites = {s.site: s for s in fp.report(model).sites if s.op in ("gated_residual", "layernorm_scale_shift", "gelu_cat")}
    gates = ("gate_msa", "gate_mlp", "c_gate_msa", "c_gate_mlp")
    assert sorted(sites) == sorted(
        [f"transformer_blocks.{i}:{g}" for i in range(2) for g in gates]
        + [f"single_transformer_blocks.{i}:{n}" for i in range(2) for n in ("gate", "gelu_cat")]
        + [f"transformer_blocks.{i}.{n}" for i in range(2) for n in ("norm1.norm", "norm1_context.norm", "norm2", "norm2_context")]
        + [f"single_transformer_blocks.{i}.norm.norm" for i in range(2)]
    )
    assert all(s.fast == 1 and s.fallback == 0 for s in sites.values()), fp.report(model, verbose=True)


def test_pipeline_with_guidance_and_a_padded_prompt_matches_unpatched(unpatch_after):
    ref_pipe, pipe = tiny_chroma_pipeline(seed=7), tiny_chroma_pipeline(seed=7)
    emb = chroma_prompt_embeddings(pipe, batch=1, txt_tokens=8, padding=3)

    def generate(p):
        p.set_progress_bar_config(disable=True)
        return p(**emb, height=64, width=64, num_inference_steps=3, guidance_scale=4.0, output_type="latent",
                 generator=torch.Generator().manual_seed(8)).images

    ref = generate(ref_pipe)
    fp.patch(pipe)
    unpatch_after(pipe)
    assert torch.equal(generate(pipe), ref)


def test_state_dict_unpatch_and_pickle():
    model = build_chroma_transformer(seed=9)
    with patch_round_trip(model, chroma_transformer_inputs(model, seed=10)):
        assert isinstance(model.transformer_blocks[0], chroma.FastpathChromaTransformerBlock)
        assert isinstance(model.single_transformer_blocks[0], chroma.FastpathChromaSingleTransformerBlock)
        assert isinstance(model.transformer_blocks[0], ChromaTransformerBlock)  # a subclass: isinstance keeps working
        assert type(model.single_transformer_blocks[1]) is chroma.FastpathChromaSingleTransformerBlock
        assert type(model.time_text_embed) is chroma.FastpathChromaCombinedTimestepTextProjEmbeddings
    assert type(model.single_transformer_blocks[0]) is ChromaSingleTransformerBlock
    assert type(model.time_text_embed) is ChromaCombinedTimestepTextProjEmbeddings


class HostCopies(TorchDispatchMode):
    """Records every op that takes a CPU tensor and returns a tensor on another device."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if "cpu" in ins and any(d != "cpu" for d in outs):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("batch, dtype", [(1, torch.bfloat16), (3, torch.float32)], ids=["b1-bf16", "b3-fp32"])
def test_time_embedding_is_exact_and_takes_nothing_from_the_host(batch, dtype, unpatch_after):
    """The patched ``time_text_embed`` gives diffusers' bits for random timesteps, and on a device other than the
    host (meta here; CUDA on a GPU, where a graph capture refuses such a copy) copies nothing from the host; diffusers'
    own does (its guidance 0 is a host tensor), which shows the check can see one."""
    model = build_chroma_transformer(dtype=dtype, seed=11)
    timestep = (torch.rand(batch, generator=torch.Generator().manual_seed(12)) * 1000).to(dtype)
    ref = model.time_text_embed(timestep)
    assert ref.abs().amax() > 0.5 and not torch.equal(ref[:, :1], ref[:, 1:2])
    fp.patch(model)
    unpatch_after(model)
    embed = model.time_text_embed
    assert type(embed) is chroma.FastpathChromaCombinedTimestepTextProjEmbeddings
    assert torch.equal(embed(timestep), ref)

    original = ChromaCombinedTimestepTextProjEmbeddings(embed.time_proj.num_channels, embed.mod_proj.shape[0])
    for module, expected in ((embed, []), (original, ["aten._to_copy.default"])):
        meta, meta_timestep = copy.deepcopy(module).to("meta"), timestep.to("meta")
        with HostCopies() as copies:
            out = meta(meta_timestep)
        assert out.device.type == "meta" and out.shape == ref.shape and copies.ops == expected


def test_gradients_flow_through_the_eager_path(unpatch_after):
    ref_model, model = build_chroma_transformer(dtype=torch.float32, seed=11), build_chroma_transformer(dtype=torch.float32, seed=11)
    inputs = chroma_transformer_inputs(model, seed=12)
    fp.patch(model)
    unpatch_after(model)
    for m in (ref_model, model):
        m(**inputs).sample.square().mean().backward()
    for (name, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name


def test_patched_model_compiles_with_fullgraph():
    """The rewritten forwards trace without graph breaks (the fused ops are custom ops; the chains namespace is a
    plain class)."""
    model = build_chroma_transformer(seed=13)
    assert_compiles_fullgraph_exactly(model, chroma_transformer_inputs(model, seed=14, masked=2))


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offload_on_a_patched_chroma(offload_type, unpatch_after):
    """diffusers' group offloading (CPU to CPU here; the GPU cells are FLUX's), patched after it is enabled, against
    the unpatched model with the same setup. (diffusers' caches do not register Chroma's blocks: unpatched
    ``enable_cache`` raises, so there is nothing to compare.)"""
    ref_model, model = build_chroma_transformer(seed=15), build_chroma_transformer(seed=15)
    kwargs = dict(num_blocks_per_group=1) if offload_type == "block_level" else {}
    for m in (ref_model, model):
        m.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type=offload_type, **kwargs)
    inputs = chroma_transformer_inputs(model, seed=16)
    fp.patch(model)
    unpatch_after(model)
    for _ in range(2):
        assert torch.equal(run(model, inputs), run(ref_model, inputs))


class MaskProducts(TorchDispatchMode):
    """Counts the boolean [B, 1, S, S] products (the outer-product attention mask) a forward computes."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mul.Tensor and out.dtype == torch.bool and out.dim() == 4:
            self.count += 1
        return out


def test_the_outer_mask_is_built_once_per_forward_with_the_same_bits(unpatch_after):
    """Each Chroma block expands the forward's [B, S] mask to [B, 1, S, S] again; patched, the first block's product
    is handed to the others (kept on the forward's rotary table), and the output is the same bits."""
    model = build_chroma_transformer(dtype=torch.float32, seed=21)
    inputs = chroma_transformer_inputs(model, batch=2, grid=(4, 4), txt_tokens=7, seed=22, masked=3)
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    with MaskProducts() as eager:
        ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    with MaskProducts() as patched:
        out = run(model, inputs)
        again = run(model, inputs)  # a second forward builds its own (a new table: nothing kept across forwards)
    assert eager.count == blocks and patched.count == 2
    assert torch.equal(out, ref) and torch.equal(again, ref)
    with torch.inference_mode():  # an inference mask has no version counter: expanded in every block, as written
        inference_inputs = {k: v.clone() for k, v in inputs.items()}
        with MaskProducts() as inference:
            assert torch.equal(model(**inference_inputs).sample, ref)
    assert inference.count == blocks


@pytest.mark.parametrize("change", ["new-mask", "in-place"])
def test_a_mask_changed_between_blocks_is_expanded_again(change, unpatch_after):
    """A hook that gives a later block another mask, or writes the forward's mask in place before it, gets that
    block the product of what it sees, as unpatched (the kept product is for one mask object at one version)."""
    model = build_chroma_transformer(dtype=torch.float32, seed=23)
    inputs = chroma_transformer_inputs(model, batch=1, grid=(4, 4), txt_tokens=7, seed=24, masked=2)

    def hook(module, args, kwargs):
        mask = kwargs["attention_mask"]
        if change == "new-mask":
            kwargs["attention_mask"] = torch.ones_like(mask)
        else:
            mask[:, 2] = False
        return args, kwargs

    def with_hook(m):
        handle = m.single_transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                return m(**{k: v.clone() for k, v in inputs.items()}).sample
        finally:
            handle.remove()

    ref, plain = with_hook(model), run(model, inputs)
    assert not torch.equal(ref, plain)  # the hook's change reaches the output
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(with_hook(model), ref)
