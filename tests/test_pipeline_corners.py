"""Pipelines whose components change around `patch`: a component compiled after `patch` (or before), an offload hook
that outlives `unpatch` holding the graphs' forward, a model config replaced between calls with CUDA graphs on (the
stand-ins `SimulatedGraphs` / `TracedGraphs`: like a CUDA graph, the latter runs no Python on replay). Found by a
review of pipeline-level patching; each test failed at 1b43881."""
import torch
import pytest

import diffusers_fastpath as fp
from diffusers_fastpath import graphs
from diffusers_fastpath._state import STATE_ATTR
from diffusers_fastpath.testing import SimulatedGraphs, prompt_embeddings, tiny_flux_pipeline


def _gen(pipe, seed=1):
    pipe.set_progress_bar_config(disable=True)
    return pipe(**prompt_embeddings(pipe), height=64, width=64, num_inference_steps=2, output_type="latent",
                generator=torch.Generator().manual_seed(seed)).images


# --- 1. a component wrapped by torch.compile after patch (README: "patch first, then compile") ----------------------

def test_unpatch_report_and_quality_of_a_pipeline_whose_patched_transformer_was_then_compiled():
    pipe = tiny_flux_pipeline(seed=3)
    fp.patch(pipe)
    inner = pipe.transformer
    pipe.transformer = torch.compile(pipe.transformer)  # the usual diffusers idiom, after patch as documented
    try:
        # patch, report, quality and unpatch all reach the model inside the wrapper
        fp.patch(pipe, quality="high")
        assert inner.__dict__[STATE_ATTR].default_quality == "high"
        fp.patch(pipe, quality="lossless")
        assert "transformer" in [m.name for m in fp.report(pipe).models], "report(pipe) omits the transformer"
        with fp.quality(pipe, "high"):
            assert inner.__dict__[STATE_ATTR].quality == "high", "quality(pipe) did not reach the transformer"
        fp.unpatch(pipe)
        assert STATE_ATTR not in inner.__dict__, "unpatch(pipe) left the transformer patched"
    finally:
        fp.unpatch(inner)


def test_patch_of_a_pipeline_whose_transformer_is_already_compiled_is_not_silent():
    pipe = tiny_flux_pipeline(seed=3)
    inner = pipe.transformer
    pipe.transformer = torch.compile(inner)
    try:
        # the model-level error ("already wrapped by torch.compile; patch the model first"), before anything is
        # patched (it patched the VAE alone, without a word)
        with pytest.raises(TypeError, match="FluxPipeline.transformer is already wrapped by torch.compile"):
            fp.patch(pipe)
        assert not fp.report(pipe).models
    finally:
        fp.unpatch(pipe)
        fp.unpatch(inner)


# --- 2. a hook that saved the graphs' forward outlives unpatch --------------------------------------------------------

@pytest.fixture
def simulated_graphs(monkeypatch):
    """`patch(..., cuda_graphs=True)` on a CPU with the test stand-in backend instead of CUDA."""
    install = graphs.install
    monkeypatch.setattr(graphs, "install", lambda model, state, name, backend=None:
                        install(model, state, name, backend or SimulatedGraphs()))


@pytest.mark.parametrize("offload", ["model_cpu_offload", "group_offload"])
def test_graphs_come_back_after_unpatch_and_repatch_around_an_offload_hook(offload, simulated_graphs):
    ref, pipe = tiny_flux_pipeline(seed=3), tiny_flux_pipeline(seed=3)
    fp.patch(pipe, cuda_graphs=True)
    assert fp.report(pipe).models[-1].graphs["status"] == "on"
    for p in (ref, pipe):  # an offload hook wraps the model's forward (ours, after patch): graphs pause
        if offload == "model_cpu_offload":
            p.enable_model_cpu_offload(device="cpu")
        else:
            p.transformer.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                                               offload_type="block_level", num_blocks_per_group=1)
    fp.unpatch(pipe)
    for p in (ref, pipe):  # the hook goes, putting back the forward it saved: our GraphForward
        if offload == "model_cpu_offload":
            p.remove_all_hooks()
        else:
            from diffusers.hooks import HookRegistry
            HookRegistry.check_if_exists_or_initialize(p.transformer).remove_hook("group_offloading", recurse=True)
    try:
        assert torch.equal(_gen(ref), _gen(pipe))  # (exact all along)
        leftover = pipe.transformer.__dict__.get("forward")
        assert type(leftover).__module__.split(".")[0] != "diffusers_fastpath", \
            f"after unpatch the model still holds {leftover!r}"
        fp.patch(pipe, cuda_graphs=True)
        status = fp.report(pipe).models[-1].graphs["status"]
        assert status == "on", status  # (was "off: model.forward is already replaced ..., by diffusers_fastpath")
    finally:
        fp.unpatch(pipe)


# --- 3. a graph replayed after the model's config changed (SkyReels-V2 diffusion forcing's causal_block_size) -------

def _skyreels_df_pipe():
    from diffusers import SkyReelsV2DiffusionForcingPipeline, UniPCMultistepScheduler

    from diffusers_fastpath.testing.zoo import build
    from diffusers_fastpath.testing.zoo.pipelines import _wan_vae
    return SkyReelsV2DiffusionForcingPipeline(
        tokenizer=None, text_encoder=None, transformer=build("skyreels-v2", seed=3), vae=_wan_vae(21),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0))


def _skyreels_df_run(pipe, causal_block_size):
    from diffusers_fastpath.testing.zoo.pipelines import _embeds

    pipe.set_progress_bar_config(disable=True)
    randn, dim = _embeds(22), pipe.transformer.config.text_dim
    return pipe(prompt=None, prompt_embeds=randn(1, 8, dim), negative_prompt_embeds=randn(1, 8, dim), height=32,
                width=32, num_frames=13, num_inference_steps=2, guidance_scale=6.0, output_type="latent",
                causal_block_size=causal_block_size, generator=torch.Generator().manual_seed(1)).frames


@pytest.fixture
def traced_graphs(monkeypatch):
    """`patch(..., cuda_graphs=True)` on a CPU with `TracedGraphs`: like a CUDA graph, no Python runs on replay."""
    from diffusers_fastpath.testing import TracedGraphs

    install = graphs.install
    monkeypatch.setattr(graphs, "install", lambda model, state, name, backend=None:
                        install(model, state, name, backend or TracedGraphs()))


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_new_causal_block_size_is_not_served_by_a_graph_captured_for_the_old_one(cuda_graphs, traced_graphs,
                                                                                     emulated_kernels):
    """The DF pipeline calls ``transformer._set_ar_attention(causal_block_size)`` (``register_to_config``) before its
    loop; the forward builds a block-causal mask from ``self.config.num_frame_per_block``. Same shapes, so the same
    graph signature, and the fingerprint does not look at the config: the second generation replays the graph
    captured without the mask. Passes with cuda_graphs=False."""
    ref, pipe = _skyreels_df_pipe(), _skyreels_df_pipe()
    fp.patch(pipe, cuda_graphs=cuda_graphs)
    try:
        a1 = _skyreels_df_run(ref, 1)
        assert torch.equal(a1, _skyreels_df_run(ref, 1))  # deterministic
        assert torch.equal(_skyreels_df_run(pipe, 1), a1)
        a2 = _skyreels_df_run(ref, 2)
        assert not torch.equal(a1, a2)  # the causal blocks matter
        assert torch.equal(_skyreels_df_run(pipe, 2), a2), fp.report(pipe).models[-1].graphs
    finally:
        fp.unpatch(pipe)


# --- found by a second review of the API (each failed at 498cd06) ---------------------------------------------------

def test_a_model_patched_then_compiled_is_reported_tiered_repatched_and_unpatched_through_the_wrapper():
    from diffusers_fastpath.testing import build_flux_transformer

    model = build_flux_transformer(seed=1)
    fp.patch(model)
    compiled = torch.compile(model)  # README: fp.patch(model); model = torch.compile(model)
    try:
        assert [m.name for m in fp.report(compiled).models] == ["FluxTransformer2DModel"]
        with fp.quality(compiled, "high"):
            assert model.__dict__[STATE_ATTR].quality == "high"
        fp.patch(compiled, quality="high")
        assert model.__dict__[STATE_ATTR].default_quality == "high"
        fp.unpatch(compiled)
        assert STATE_ATTR not in model.__dict__
    finally:
        fp.unpatch(model)
    with pytest.raises(TypeError, match="patch the model first, then compile"):  # compiled before patch: refused
        fp.patch(torch.compile(build_flux_transformer(seed=2)))


def test_unfusing_qkv_after_unpatch_gives_diffusers_processors_back(emulated_kernels):
    """``fuse_qkv_projections`` keeps the processors it replaces (this package's, while patched) and
    ``unfuse_qkv_projections`` sets them again: unpatched in between, the model must get diffusers' back, as its
    never-patched twin does, and a later patch / unpatch leaves none of this package's behind."""
    from diffusers_fastpath.testing import build_sd3_transformer, sd3_transformer_inputs

    ref = build_sd3_transformer(seed=3, num_layers=2, dual_attention_layers=())
    model = build_sd3_transformer(seed=3, num_layers=2, dual_attention_layers=())
    fp.patch(model)
    for m in (ref, model):
        m.fuse_qkv_projections()
    fp.unpatch(model)
    for m in (ref, model):
        m.unfuse_qkv_projections()

    def kinds(m):
        return sorted({f"{type(p).__module__}.{type(p).__name__}" for p in m.attn_processors.values()})

    assert kinds(model) == kinds(ref) == ["diffusers.models.attention_processor.JointAttnProcessor2_0"]
    fp.patch(model)
    assert kinds(model) != kinds(ref)  # patched: this package's processors again
    fp.unpatch(model)
    assert kinds(model) == kinds(ref)
    inputs = sd3_transformer_inputs(ref, seed=4)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, ref(**inputs).sample)


def test_a_unet_pipeline_gets_its_vae_patched_and_is_told_the_unet_runs_as_written(fastpath_log, unpatch_after):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
                                layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=8,
                                norm_num_groups=4, attention_head_dim=2)
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=DDIMScheduler(),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    unpatch_after(fp.patch(pipe))
    assert [m.name for m in fp.report(pipe).models] == ["vae"] and STATE_ATTR not in unet.__dict__
    warnings = [r.getMessage() for r in fastpath_log.records if r.levelname == "WARNING"]
    assert any("only vae (AutoencoderKL) is patched" in w and "unet=UNet2DConditionModel" in w
               and "not what this package patches" in w for w in warnings), warnings


def test_patching_again_with_verify_turns_the_generic_paths_verification_on():
    from diffusers_fastpath.testing import zoo

    model = zoo.build("sana", seed=3)
    fp.patch(model, verify=False)
    try:
        state = model.__dict__[STATE_ATTR]
        assert getattr(state, "verifier", None) is None and "verification skipped" in str(fp.report(model))
        fp.patch(model)  # the default (on): asked again, now on
        assert state.verifier is not None and "verification skipped" not in str(fp.report(model))
        inputs = zoo.inputs("sana", model)
        with torch.no_grad():
            model(**inputs)
        assert len(state.verifier.verified) == 1
        fp.patch(model, verify=False)  # once on, it stays on
        assert state.verifier is not None
        with pytest.raises(TypeError, match="verify must be True, False or None"):
            fp.patch(model, verify="0")
    finally:
        fp.unpatch(model)


@pytest.mark.parametrize("obj", [None, "black-forest-labs/FLUX.1-dev", 3])
def test_report_of_an_object_that_is_neither_a_pipeline_nor_a_model_is_one_line(obj):
    rep = fp.report(obj)
    assert not rep.models and "is not supported" in str(rep) and "nothing is patched" in str(rep)
