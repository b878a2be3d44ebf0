"""FLUX.1 adapter on CPU: exactness, state dicts, reversibility, the rotary tables, processors, errors."""

from __future__ import annotations

import hashlib

import pytest
import torch
from diffusers import DiffusionPipeline, FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import (
    FluxAttnProcessor,
    FluxIPAdapterAttnProcessor,
    FluxPosEmbed,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)

import diffusers_fastpath as fp
from diffusers_fastpath.models import flux as flux_adapter
from diffusers_fastpath.ops import Site
from diffusers_fastpath._state import SITE_ATTR, STATE_ATTR
from diffusers_fastpath.models._handoff import GATED_MODULATE, REASON_FP16
from diffusers_fastpath.models._pos_embed import FastpathFluxPosEmbed
from diffusers_fastpath.report import kernels_line
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs, prompt_embeddings, tiny_flux_pipeline


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


FUSED_OPS = {"modulate_scale_shift", "layernorm_scale_shift", "gated_residual", "qk_norm_rope", "rotary_emb",
             GATED_MODULATE}


def fused_sites(rep):
    """The sites of fused kernels (not the concatenation rewrites, which need no kernel)."""
    return [s for s in rep.sites if s.op in FUSED_OPS]


def sites_by_op(rep, op):
    return {s.site: s for s in rep.sites if s.op == op}


def snapshot(model):
    """Everything unpatch must restore: module types, processor objects, hooks, instance attributes."""
    return [
        (
            name,
            type(m),
            getattr(m, "processor", None),
            dict(m._forward_hooks),
            dict(m._forward_pre_hooks),
            sorted(k for k in vars(m) if k.startswith("_fastpath")),
        )
        for name, m in model.named_modules()
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch,guidance", [(1, False), (2, True)])
def test_patched_transformer_matches_unpatched_bitwise(dtype, batch, guidance, unpatch_after):
    model = build_flux_transformer("flux-tiny", dtype, seed=batch, guidance_embeds=guidance)
    inputs = flux_transformer_inputs(model, batch=batch, grid=(4, 6), txt_tokens=7, seed=10 + batch)
    ref = run(model, inputs)
    assert ref.std() > 0.01  # random weights everywhere: nothing collapses to zeros
    fp.patch(model)
    unpatch_after(model)
    for _ in range(2):  # second call: rotary cache reused
        assert torch.equal(run(model, inputs), ref)
    rep = fp.report(model)
    # per dual block 4 LayerNorm+modulate + 4 gated residual sites; per single block 1 + 1, the GELU + concatenation,
    # and the token concatenation (not in the first single block: its inputs are always two tensors); per attention
    # module 2 (the fused QK norm + rotary, and the pure rotary it falls back to); each dual block's joint value
    # projections; the fused update + LayerNorm-modulate (`_handoff`) of each dual block's norm2 and norm2_context and of
    # the adaLNs a block hands its streams to (the second dual block's two, the second single block's)
    assert len(rep.sites) == 2 * 8 + 2 * 4 - 1 + 4 * 2 + 2 + 2 * 2 + 2 + 1
    assert len(sites_by_op(rep, "gated_residual")) == 2 * 4 + 2
    assert sorted(sites_by_op(rep, GATED_MODULATE)) == sorted(
        [f"transformer_blocks.{i}.{n}:gated" for i in range(2) for n in ("norm2", "norm2_context")]
        + ["transformer_blocks.1.norm1:gated", "transformer_blocks.1.norm1_context:gated",
           "single_transformer_blocks.1.norm:gated"])
    reason = "dtype float32" if dtype == torch.float32 else "device cpu"
    # float16 streams that diffusers clips between blocks (the text stream, the single blocks') are not handed off
    clipped = {"transformer_blocks.1.norm1_context:gated", "single_transformer_blocks.1.norm:gated"}
    calls = {"qk_norm_rope": 4, "rotary_emb": 4}  # two forwards; q and k per attention
    assert all(s.fast == 0 and s.reasons == {REASON_FP16 if dtype == torch.float16 and s.site in clipped else reason:
                                             calls.get(s.op, 2)} for s in fused_sites(rep)), str(rep)
    cat_tokens = sites_by_op(rep, flux_adapter.JOINT_TOKENS_VIEW)
    assert "single_transformer_blocks.0:cat_tokens" not in cat_tokens
    assert cat_tokens["single_transformer_blocks.1:cat_tokens"].fast == 2  # the previous block's output, no copy


def test_patched_pipeline_matches_unpatched(unpatch_after):
    pipe = tiny_flux_pipeline(seed=4)
    emb = prompt_embeddings(pipe, txt_tokens=6, seed=5)

    def generate():
        gen = torch.Generator().manual_seed(7)
        out = pipe(**emb, height=64, width=64, num_inference_steps=3, generator=gen, output_type="np")
        return hashlib.md5(out.images.tobytes()).hexdigest(), out.images

    ref_md5, ref = generate()
    assert ref.std() > 0.01
    assert fp.patch(pipe) is pipe
    unpatch_after(pipe)
    md5, _ = generate()
    assert md5 == ref_md5
    rep = fp.report(pipe)
    assert sorted(m.name for m in rep.models) == ["transformer", "vae"]  # patch(pipe) patches the VAE too


def test_state_dict_is_unchanged(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=3)
    before = model.state_dict()
    fp.patch(model)
    unpatch_after(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in before)
    model.load_state_dict(before)  # loads into the patched modules too


def test_save_pretrained_round_trip(tmp_path, unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=8)
    inputs = flux_transformer_inputs(model, seed=9)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    model.save_pretrained(tmp_path)
    loaded = FluxTransformer2DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    assert type(loaded) is FluxTransformer2DModel
    assert type(loaded.transformer_blocks[0]) is FluxTransformerBlock
    assert torch.equal(run(loaded, inputs), ref)
    fp.patch(loaded)
    unpatch_after(loaded)
    assert torch.equal(run(loaded, inputs), ref)


def test_unpatch_restores_everything(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=11)
    inputs = flux_transformer_inputs(model, seed=12)
    ref = run(model, inputs)
    before = snapshot(model)
    fp.patch(model)
    unpatch_after(model)
    assert type(model.transformer_blocks[0].norm1).__name__ == "FastpathAdaLayerNormZero"
    assert type(model.transformer_blocks[0].attn.processor).__name__ == "FastpathFluxAttnProcessor"
    run(model, inputs)
    assert fp.unpatch(model) is model
    assert snapshot(model) == before  # same types, the very same processor objects, no hooks or attributes left
    assert STATE_ATTR not in vars(model)
    assert torch.equal(run(model, inputs), ref)
    fp.unpatch(model)  # unpatching an unpatched model is a no-op
    assert snapshot(model) == before


def test_patch_twice_changes_nothing(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=13)
    before = snapshot(model)
    fp.patch(model)
    unpatch_after(model)
    once = snapshot(model)
    state = vars(model)[STATE_ATTR]
    fp.patch(model)
    assert vars(model)[STATE_ATTR] is state
    assert snapshot(model) == once
    fp.unpatch(model)
    assert snapshot(model) == before


def test_hooks_and_parameters_survive_the_class_swap(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=14)
    norm1 = model.transformer_blocks[0].norm1
    weight = norm1.linear.weight
    seen = []
    norm1.register_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    fp.patch(model)
    unpatch_after(model)
    run(model, flux_transformer_inputs(model, seed=15))
    assert seen == ["FastpathAdaLayerNormZero"] and norm1.linear.weight is weight
    assert isinstance(norm1, type(norm1).__mro__[1])  # still an AdaLayerNormZero for isinstance checks


def test_gradients_flow_through_the_eager_path(unpatch_after):
    """Autograd (LoRA training) is guarded out of the kernels: gradients equal unpatched ones."""
    model = build_flux_transformer("flux-tiny", torch.float32, seed=16)
    inputs = flux_transformer_inputs(model, seed=17)

    def grads():
        model.zero_grad()
        model(**inputs).sample.square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads()
    fp.patch(model)
    unpatch_after(model)
    assert all(torch.equal(a, b) for a, b in zip(grads(), ref))
    rep = fp.report(model)
    assert {r for s in fused_sites(rep) for r in s.reasons} == {"dtype float32", "requires grad"}
    # (the hand-offs between blocks refuse autograd before their op looks at the dtype)
    assert {r for s in sites_by_op(rep, GATED_MODULATE).values() if s.site.endswith((".norm1:gated", ".norm:gated"))
            for r in s.reasons} == {"requires grad"}
    assert sites_by_op(rep, flux_adapter.JOINT_TOKENS_VIEW)["single_transformer_blocks.1:cat_tokens"].reasons == {
        "requires grad": 1
    }


def test_rotary_tables_are_diffusers_own_built_once_per_forward(unpatch_after):
    """No cache across forwards: every block of one forward gets the one (cos, sin) built from this forward's ids,
    equal to what diffusers' own FluxPosEmbed builds (the patched one builds all axes at once: `_pos_embed`), and the
    next forward builds its own."""
    model = build_flux_transformer("flux-tiny", seed=20)
    inputs = flux_transformer_inputs(model, grid=(3, 5), txt_tokens=4, seed=21)
    ids = torch.cat((inputs["txt_ids"], inputs["img_ids"]))
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=model.config.axes_dims_rope)(ids)
    fp.patch(model)
    unpatch_after(model)
    assert type(model.pos_embed) is FastpathFluxPosEmbed
    captured = []
    for block in (*model.transformer_blocks, *model.single_transformer_blocks):
        block.attn.register_forward_pre_hook(
            lambda mod, args, kwargs: captured.append(kwargs["image_rotary_emb"]), with_kwargs=True
        )
    run(model, inputs)
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    first = captured[0]
    assert type(first) is tuple and all(r is first for r in captured[:blocks])
    assert torch.equal(first[0], cos) and torch.equal(first[1], sin)
    run(model, inputs)
    assert captured[blocks] is not first and captured[blocks][0] is not first[0]


def test_ip_adapter_and_user_processors_are_left_alone(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=22)
    ip = FluxIPAdapterAttnProcessor(hidden_size=32, cross_attention_dim=32)
    model.transformer_blocks[1].attn.set_processor(ip)
    fp.patch(model)
    unpatch_after(model)
    assert model.transformer_blocks[1].attn.processor is ip
    rep = fp.report(model)
    assert rep.models[0].processors == 3
    assert any("FluxIPAdapterAttnProcessor" in note for note in rep.models[0].notes)

    mine = FluxAttnProcessor()
    model.transformer_blocks[0].attn.set_processor(mine)  # set by the user after patching
    fp.unpatch(model)
    assert model.transformer_blocks[0].attn.processor is mine
    assert model.transformer_blocks[1].attn.processor is ip


def test_attention_backend_settings_carry_over(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=23)
    attn = model.single_transformer_blocks[0].attn
    attn.processor._attention_backend = "native"
    fp.patch(model)
    unpatch_after(model)
    assert attn.processor._attention_backend == "native"
    assert model.single_transformer_blocks[1].attn.processor._attention_backend is None


def test_a_changed_diffusers_source_leaves_that_part_unpatched(monkeypatch, fastpath_log, unpatch_after):
    monkeypatch.setattr(flux_adapter, "_BLOCK_FORWARD", "0" * 16)
    model = build_flux_transformer("flux-tiny", seed=24)
    inputs = flux_transformer_inputs(model, seed=25)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    assert type(model.transformer_blocks[0]) is FluxTransformerBlock
    assert SITE_ATTR not in vars(model.transformer_blocks[0].norm2)
    assert type(model.transformer_blocks[0].norm1).__name__ == "FastpathAdaLayerNormZero"
    assert torch.equal(run(model, inputs), ref)
    assert any("FluxTransformerBlock.forward is not the version" in r.getMessage() for r in fastpath_log.records)


def test_mirrored_sources_match_the_installed_diffusers():
    """The pinned digests are those of the diffusers this package targets; a mismatch means re-mirroring."""
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    from diffusers_fastpath._source import source_digest

    assert source_digest(FluxTransformerBlock.forward) == flux_adapter._BLOCK_FORWARD
    assert source_digest(FluxSingleTransformerBlock.forward) == flux_adapter._SINGLE_BLOCK_FORWARD
    assert source_digest(FluxAttnProcessor.__call__) == flux_adapter._PROCESSOR_CALL
    assert source_digest(AdaLayerNormZero.forward) == flux_adapter._ADALN_ZERO_FORWARD
    assert source_digest(AdaLayerNormZeroSingle.forward) == flux_adapter._ADALN_ZERO_SINGLE_FORWARD


class _VaeOnlyPipeline(DiffusionPipeline):
    def __init__(self, vae):
        super().__init__()
        self.register_modules(vae=vae)


def test_clear_errors():
    supported = ", ".join(fp.supported_classes())
    with pytest.raises(TypeError, match=f"does not support Linear.*Supported: {supported}"):
        fp.patch(torch.nn.Linear(2, 2))
    pipe = _VaeOnlyPipeline(torch.nn.Linear(2, 2))  # (FLUX's AutoencoderKL is supported: models/vae_kl.py)
    with pytest.raises(ValueError, match="holds no supported model \\(vae=Linear\\).*FluxTransformer2DModel"):
        fp.patch(pipe)
    with pytest.raises(ValueError, match="unknown quality tier 'ultra'"):
        fp.patch(build_flux_transformer("flux-tiny"), quality="ultra")
    with pytest.raises(TypeError, match="expected a diffusers DiffusionPipeline or ModularPipeline, or a model"):
        fp.patch("black-forest-labs/FLUX.1-dev")
    with pytest.raises(TypeError, match="patch the model first, then compile"):
        fp.patch(torch.compile(build_flux_transformer("flux-tiny")))
    assert fp.supported_classes() == sorted(fp.supported_classes())
    assert {"ChromaTransformer2DModel", "ErnieImageTransformer2DModel", "FluxTransformer2DModel"} <= set(fp.supported_classes())


def test_report_prints_a_summary_a_table_and_plain_data(unpatch_after):
    pipe = tiny_flux_pipeline(seed=26)
    fp.patch(pipe)
    unpatch_after(pipe)
    pipe(**prompt_embeddings(pipe), height=32, width=32, num_inference_steps=2, output_type="latent")
    rep = fp.report(pipe)
    summary = str(rep).splitlines()
    # where this process's kernels stand: on a CPU "no CUDA kernels run here"; on a GPU machine "not loaded" or, if
    # an earlier test loaded them, where they came from
    assert summary[0] == f"diffusers_fastpath: {kernels_line()}"
    if not torch.cuda.is_available():
        assert summary[0].startswith("diffusers_fastpath: no CUDA kernels run here (")
    # 2 dual + 2 single blocks, 2 steps: only the second single block's token concatenation is no kernel (no copy)
    # the pipeline's VAE is patched too (models/vae_kl.py; not called: output_type="latent"), listed first as the
    # pipeline lists its components
    assert summary[1].startswith("vae (AutoencoderKL): quality=lossless; 78 fused sites, 0 fast calls, 0 fallbacks;")
    transformer = next(line for line in summary if line.startswith("transformer ("))
    assert transformer.startswith("transformer (FluxTransformer2DModel): quality=lossless; 40 fused sites, 2 fast calls, "
                                  "94 fallbacks;")
    per_op = {cells[0]: cells[1:] for line in summary if line.startswith("  | ")
              for cells in [[c.strip() for c in line.split("|")[1:-1]]]}
    assert per_op["layernorm_scale_shift"] == ["10", "0", "20", "device cpu: 20"]  # 4 per dual block, 1 per single
    assert per_op["joint_tokens_view"] == ["1", "2", "0", "-"]
    assert "  high tier: 0 of 6 sites mounted, 0 approximate calls" in summary and len(summary) < 23
    assert any(line.startswith("image/video post-processing (pinned copy, process-wide): ") for line in summary)
    assert summary[-1] == "(print(fp.report(obj, verbose=True)) lists every site)"

    text = str(fp.report(pipe, verbose=True))
    assert "| site" in text and "transformer.transformer_blocks.0.norm1 " in text and "device cpu: 2" in text
    assert "| total" in text
    data = rep.to_dict()
    assert data["ops"]["modulate_scale_shift"] == "enabled"
    transformer_sites = [row for row in data["sites"] if row["model"] == "transformer"]
    assert len(transformer_sites) == 23 + 4 * 2 + 2 + 7 and transformer_sites[0]["reasons"] == {"device cpu": 2}
    assert len(data["sites"]) == len(transformer_sites) + 78  # the VAE's (36 GroupNorm sites, 42 convolutions' biases)
    assert "transformer.transformer_blocks.0:gate_msa " in text and "transformer.single_transformer_blocks.1:gate " in text
    assert "transformer.single_transformer_blocks.0:gelu_cat " in text and data["ops"]["gelu_cat"].startswith("enabled")
    assert data["ops"]["gated_residual"] == "enabled"
    assert "transformer.transformer_blocks.0.attn:qk_norm_rope " in text
    assert any({"site": "transformer_blocks.0.attn:rotary_emb", "op": "rotary_emb"}.items() <= row.items() for row in data["sites"])


def test_report_of_an_unpatched_or_unsupported_object_says_so_in_one_line():
    pipe = tiny_flux_pipeline()
    rep = fp.report(pipe)
    assert rep.sites == [] and rep.models == []
    assert str(rep) == (
        "diffusers_fastpath: FluxPipeline is not patched (vae (AutoencoderKL), transformer (FluxTransformer2DModel)); "
        "call diffusers_fastpath.patch on it first."
    )
    assert str(fp.report(pipe.transformer)).startswith("diffusers_fastpath: FluxTransformer2DModel is not patched")
    assert str(fp.report(torch.nn.Linear(2, 2))) == (
        f"diffusers_fastpath: Linear is not supported (supported: {', '.join(fp.supported_classes())}); "
        "nothing is patched."
    )


def test_env_switch_is_reported(monkeypatch, unpatch_after):
    from diffusers_fastpath.ops import OPS
    from diffusers_fastpath.ops._policy import ENV_DISABLE, REASON_ENV

    monkeypatch.setenv(ENV_DISABLE, "1")
    for op in OPS.values():
        op.reset()
    model = build_flux_transformer("flux-tiny", seed=27)
    fp.patch(model)
    unpatch_after(model)
    run(model, flux_transformer_inputs(model, seed=28))
    rep = fp.report(model)
    assert rep.ops["modulate_scale_shift"] == REASON_ENV
    assert rep.ops["gated_residual"] == REASON_ENV
    assert all(s.reasons == {REASON_ENV: 2 if s.op in ("qk_norm_rope", "rotary_emb") else 1} for s in fused_sites(rep))


def test_patched_model_compiles_with_fullgraph(unpatch_after):
    """The patched forward (hooks, rotary cache, fused-op dispatch) traces without graph breaks."""
    model = build_flux_transformer("flux-tiny", seed=29)
    inputs = flux_transformer_inputs(model, seed=30)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(run(compiled, inputs), ref)


# --- gated residual sites and the single block's concatenations ---------------------------------------------------


def _kernel_arithmetic(residual, gate, update):
    """What csrc/gated_residual.cu computes, written with torch: fp32 math, rounded to T after the multiply and the
    add. Run as the 'kernel' on CPU, it exercises the fast path's wiring and the rounding model together."""
    product = (gate.float() * update.float()).to(residual.dtype)
    return (residual.float() + product.float()).to(residual.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_gated_residual_sites_on_the_fast_path_are_exact(dtype, batch, monkeypatch, unpatch_after):
    from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL

    model = build_flux_transformer("flux-tiny", dtype, seed=40 + batch)
    inputs = flux_transformer_inputs(model, batch=batch, grid=(4, 6), txt_tokens=7, seed=41)
    ref = run(model, inputs)
    monkeypatch.setattr(GATED_RESIDUAL, "guard", lambda *a, check_pointers=True: None)
    monkeypatch.setattr(GATED_RESIDUAL, "kernel", _kernel_arithmetic)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), ref)
    sites = sites_by_op(fp.report(model), "gated_residual")
    assert sorted(sites) == sorted(
        [f"transformer_blocks.{i}:{g}" for i in range(2) for g in ("gate_msa", "gate_mlp", "c_gate_msa", "c_gate_mlp")]
        + [f"single_transformer_blocks.{i}:gate" for i in range(2)]
    )
    assert all(s.fast == 1 and s.fallback == 0 for s in sites.values())


def test_a_failing_gated_residual_kernel_is_disabled_once_and_the_model_stays_exact(
    monkeypatch, unpatch_after, fastpath_log
):
    from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL

    model = build_flux_transformer("flux-tiny", seed=42)
    inputs = flux_transformer_inputs(model, seed=43)
    ref = run(model, inputs)

    def failing(*args):
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(GATED_RESIDUAL, "guard", lambda *a, check_pointers=True: None)
    monkeypatch.setattr(GATED_RESIDUAL, "kernel", failing)
    fp.patch(model)
    unpatch_after(model)
    for _ in range(2):
        assert torch.equal(run(model, inputs), ref)
    rep = fp.report(model)
    assert rep.ops["gated_residual"] == "disabled (RuntimeError: injected kernel failure)"
    assert rep.ops["modulate_scale_shift"] == "enabled"
    assert all(s.fast == 0 and s.reasons == {"op disabled after an error": 2} for s in sites_by_op(rep, "gated_residual").values())
    assert sum("disabling the fused op 'gated_residual'" in r.getMessage() for r in fastpath_log.records) == 1


def test_joint_tokens_is_the_base_of_two_adjacent_halves():
    base = torch.randn(2, 11, 32)
    site = Site(flux_adapter.JOINT_TOKENS_VIEW)
    text, image = base[:, :4], base[:, 4:]
    assert flux_adapter._joint_tokens(text, image, site) is base
    assert torch.equal(base, torch.cat([text, image], dim=1))
    other = base.clone()
    cases = {
        "separate": (text.clone(), image.clone(), "text and image are separate tensors"),
        "mixed bases": (text, other[:, 4:], "text and image are separate tensors"),
        "swapped": (base[:, 7:], base[:, :7], "not the two halves of one tensor"),
        "gap": (base[:, :4], base[:, 5:], "not the two halves of one tensor"),
        "overlap": (base[:, :5], base[:, 4:], "not the two halves of one tensor"),
        "column slices": (base[..., :16], base[..., 16:], "not the two halves of one tensor"),
        "batch halves": (base[:1], base[1:], "not the two halves of one tensor"),
        "transposed base": (*torch.randn(11, 2, 32).transpose(0, 1).split([4, 7], dim=1), "not the two halves of one tensor"),
    }
    for name, (a, b, reason) in cases.items():
        site = Site(flux_adapter.JOINT_TOKENS_VIEW)
        out = flux_adapter._joint_tokens(a, b, site)
        assert torch.equal(out, torch.cat([a, b], dim=1)) and out is not base, name
        assert site.fast == 0 and dict(site.fallback) == {reason: 1}, name

    leaf = torch.randn(2, 11, 32, requires_grad=True)
    grown = leaf * 2
    site = Site(flux_adapter.JOINT_TOKENS_VIEW)
    out = flux_adapter._joint_tokens(grown[:, :4], grown[:, 4:], site)
    assert out is not grown and out.grad_fn is not None and dict(site.fallback) == {"requires grad": 1}
    with torch.no_grad():
        assert flux_adapter._joint_tokens(grown[:, :4], grown[:, 4:], site) is grown


def test_single_blocks_never_write_into_their_inputs(unpatch_after):
    """The joint-token view hands the previous block's output to the next block as its residual: the block must
    only read it. Every single block's input is compared before and after the block runs."""
    model = build_flux_transformer("flux-tiny", seed=44)
    inputs = flux_transformer_inputs(model, batch=2, seed=45)
    fp.patch(model)
    unpatch_after(model)
    seen = []

    def before(mod, args, kwargs):
        text, image = kwargs["encoder_hidden_states"], kwargs["hidden_states"]
        seen.append(((text, image), (text.clone(), image.clone())))

    def after(mod, args, kwargs, output):
        (text, image), (text0, image0) = seen[-1]
        assert torch.equal(text, text0) and torch.equal(image, image0)
        assert all(o.data_ptr() != t.data_ptr() for o in output for t in (text, image))  # fresh outputs

    for block in model.single_transformer_blocks:
        block.register_forward_pre_hook(before, with_kwargs=True)
        block.register_forward_hook(after, with_kwargs=True)
    run(model, inputs)
    assert len(seen) == 2
    assert fp.report(model).sites  # the hooks ran on the patched blocks
    cat_tokens = sites_by_op(fp.report(model), flux_adapter.JOINT_TOKENS_VIEW)
    assert cat_tokens["single_transformer_blocks.1:cat_tokens"].fast == 1
