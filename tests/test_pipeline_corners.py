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
