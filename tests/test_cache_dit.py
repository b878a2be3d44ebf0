"""cache-dit (the most used cache library for diffusers) in the works-with matrix, on CPU where it is installed:
`patch` and ``cache_dit.enable_cache`` in either order, undone in either order, for FLUX.1, Wan 2.1 and Qwen-Image
(the three ways cache-dit 1.5.3 takes a transformer: FLUX through its patch functor, which puts its own forward on
the instance; Wan with CFG as separate cached calls; Qwen-Image with true CFG of two text lengths).

Each generation is `torch.equal` to cache-dit alone on the unpatched twin, and everything undone leaves the
pipeline as cache-dit alone leaves it. With CUDA graphs (issue 43, item 10; the runner over `SimulatedGraphs`, which
runs the recorded forward again on every replay, as a capture's warm-up and checking replay run it on the GPU):
no forward runs through cache-dit's wrapper but the pipeline's own calls, `report` says why graphs do not capture,
and ``disable_cache`` puts the graphs' forward back. The real captures are in `test_cache_dit_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath import graphs
from diffusers_fastpath._state import STATE_ATTR
from diffusers_fastpath.testing import (
    SimulatedGraphs,
    build_qwenimage_transformer,
    build_wan_transformer,
    prompt_embeddings,
    qwenimage_pipeline,
    qwenimage_prompt_embeddings,
    tiny_flux_pipeline,
    wan_pipeline,
)

cache_dit = pytest.importorskip("cache_dit")

STEPS = 6


def cache_config():
    """Caching that skips blocks on the tiny models' steps: the first block always computed, two warm-up steps, a
    threshold their residuals stay under (`test_the_cache_changes_the_numbers` checks that steps are cached)."""
    return cache_dit.DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2,
                                   residual_diff_threshold=2.0)


def _wan_call(pipe):
    t, gen = pipe.transformer, torch.Generator().manual_seed(3)
    prompt, negative = (torch.randn(1, 8, t.config.text_dim, generator=gen).to(t.device, t.dtype) for _ in range(2))
    return dict(prompt_embeds=prompt, negative_prompt_embeds=negative, height=16, width=16, num_frames=5,
                guidance_scale=2.0)


def generate(pipe, family):
    pipe.set_progress_bar_config(disable=True)
    common = dict(num_inference_steps=STEPS, output_type="latent", generator=torch.Generator().manual_seed(4))
    if family == "wan":
        return pipe(**_wan_call(pipe), **common).frames
    if family == "qwenimage":
        return pipe(**qwenimage_prompt_embeddings(pipe), height=32, width=32, true_cfg_scale=2.0, **common).images
    return pipe(**prompt_embeddings(pipe, seed=3), height=32, width=32, **common).images


BUILDERS = {  # (device, dtype) -> pipeline
    "flux": lambda device="cpu", dtype=torch.float32: tiny_flux_pipeline(dtype=dtype, device=device, seed=1),
    "wan": lambda device="cpu", dtype=torch.float32: wan_pipeline(build_wan_transformer(dtype=dtype, device=device,
                                                                                          seed=1)),
    "qwenimage": lambda device="cpu", dtype=torch.float32: qwenimage_pipeline(
        build_qwenimage_transformer(dtype=dtype, device=device, seed=1)),
}


def pipeline_state(pipe):
    """What a patch or cache-dit leaves on a pipeline: its class's ``__call__`` and cache-dit's class attributes,
    and per transformer module its class, instance attribute names, processor class, hooks and instance forward
    (None where nn.Module calls the class's forward: absent, or that forward bound to the module)."""
    def forward_of(m):
        f = vars(m).get("forward")
        if f is None or (getattr(f, "__self__", None) is m and getattr(f, "__func__", None) is type(m).forward):
            return None
        function = getattr(f, "__func__", None)
        return type(f).__name__, getattr(f, "__qualname__", None), getattr(function, "__qualname__", None)

    cls = type(pipe)
    modules = [(name, type(m), sorted(set(vars(m)) - {"forward"}), type(getattr(m, "processor", None)),
                len(m._forward_hooks), len(m._forward_pre_hooks), forward_of(m))
               for name, m in pipe.transformer.named_modules()]
    return cls.__call__, sorted(k for k in vars(cls) if k.startswith("_is_cached") or k == "_original_call"), \
        sorted(vars(pipe)), modules


def cache_dit_alone(family, device="cpu", dtype=torch.float32):
    """The unpatched pipeline's latents without and with cache-dit, and what cache-dit alone leaves on the pipeline
    once disabled."""
    pipe = BUILDERS[family](device, dtype)
    plain = generate(pipe, family)
    cache_dit.enable_cache(pipe, cache_config=cache_config())
    cached = generate(pipe, family)
    cache_dit.disable_cache(pipe)
    return plain, cached, pipeline_state(pipe)


def check_every_order(pipe, family, first, undo, reference, patch):
    """`patch` (this package's, with or without graphs) and cache-dit on `pipe` in the order `first`, a generation,
    both undone in the order `undo`, a generation: each as `reference` (`cache_dit_alone`) says; with graphs, what
    `report` says of them. Returns the graphs' runner (None without graphs)."""
    plain, cached, left = reference

    def enable():
        cache_dit.enable_cache(pipe, cache_config=cache_config())

    for step in (patch, enable) if first == "patch_first" else (enable, patch):
        step()
    assert torch.equal(generate(pipe, family), cached)
    runner = pipe.transformer.__dict__.get(graphs.GRAPHS_ATTR)
    if runner is not None:
        stats = next(m for m in fp.report(pipe).models if m.name == "transformer").graphs  # (the VAE: patched too)
        # never a recording: on Wan its extra forwards advanced cache-dit's steps (other latents), on Qwen-Image
        # they hit a residual of the other text length (a size mismatch); FLUX's forward is cache-dit's own
        assert stats["captures"] == stats["replays"] == 0, stats
        if first == "patch_first":
            assert stats["status"].startswith("paused: model.forward was replaced per instance after patch, by "
                                              "cache_dit."), stats
            called_us = family != "flux"  # cache-dit's FLUX forward is its functor's: ours is never called
            assert sum(stats["eager"].values()) == (2 * STEPS if called_us else 0), stats  # CFG: two calls a step
        else:
            assert stats["status"].startswith("off: model.forward is already replaced per instance, by "
                                              "cache_dit."), stats
        assert "cuda graphs: " + stats["status"] in str(fp.report(pipe))
    if undo == "unpatch_first":
        fp.unpatch(pipe)
        cache_dit.disable_cache(pipe)
    else:
        cache_dit.disable_cache(pipe)  # puts the graphs' forward back where cache-dit found it (bound again)
        if runner is not None and first == "patch_first" and family != "flux":
            assert runner.status == "on"
            assert torch.equal(generate(pipe, family), plain) and runner.replays > 0  # graphs resume
        fp.unpatch(pipe)
    assert pipeline_state(pipe) == left
    assert torch.equal(generate(pipe, family), plain)
    return runner


def references(*args):
    """`cache_dit_alone(family, *args)` per family, computed once (a module fixture's value)."""
    refs = {}

    def get(family):
        if family not in refs:
            refs[family] = cache_dit_alone(family, *args)
        return refs[family]

    return get


@pytest.fixture(scope="module")
def alone():
    return references()


@pytest.fixture
def cache_off_after():
    """Disables cache-dit at teardown where a failing test left it on: it wraps the pipeline *class*'s __call__."""
    pipes = []
    yield pipes.append
    for pipe in pipes:
        if "_original_call" in vars(type(pipe)):
            cache_dit.disable_cache(pipe)


@pytest.mark.parametrize("family", BUILDERS)
def test_the_cache_changes_the_numbers(family, alone):
    """The cells below compare something: cache-dit alone gives other latents than no cache (steps were cached)."""
    plain, cached, _ = alone(family)
    assert not torch.equal(plain, cached)


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("first", ["patch_first", "cache_first"])
@pytest.mark.parametrize("undo", ["unpatch_first", "disable_first"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["lossless", "graphs"])
def test_patch_and_cache_dit_in_every_order(family, first, undo, cuda_graphs, alone, cache_off_after, fastpath_log):
    pipe = BUILDERS[family]()
    cache_off_after(pipe)

    def patch():
        fp.patch(pipe)
        if cuda_graphs:  # what patch(pipe, cuda_graphs=True) installs, over the simulated backend
            graphs.install(pipe.transformer, pipe.transformer.__dict__[STATE_ATTR], "transformer", SimulatedGraphs())

    runner = check_every_order(pipe, family, first, undo, alone(family), patch)
    if cuda_graphs:  # every recording is a capture the runner counted (none while cache-dit was on)
        assert runner.backend.recorded == runner.captures
    # this package's warnings only (cache-dit logs its own, "Acceleration hooks is disabled for: ...", which reach
    # caplog where its logger propagates)
    assert not [r.getMessage() for r in fastpath_log.records if r.levelname == "WARNING" and r.name.startswith(
        "diffusers.fastpath") and "paused" not in r.getMessage() and "no effect" not in r.getMessage()]
