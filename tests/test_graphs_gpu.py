"""CUDA graphs on the GPU: replays are bit-identical to unpatched eager (FLUX tiny and full size, ERNIE-Image),
position ids and weights that change between calls are followed, a whole generation is md5-identical, a forward
that cannot be captured runs eager, and unpatch frees the graph pool."""

from __future__ import annotations

import gc
import hashlib

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import diffusers_fastpath as fp
from diffusers_fastpath.graphs import GRAPHS_ATTR
from diffusers_fastpath.ops import OPS
from diffusers_fastpath.ops.linear_cat import BATCH_REASON
from diffusers_fastpath.testing import (
    build_ernie_image_transformer,
    build_flux_transformer,
    clipped_refusal,
    ernie_image_inputs,
    flux_transformer_inputs,
    prompt_embeddings,
    tiny_flux_pipeline,
)

pytestmark = pytest.mark.gpu


def only_batch_fallbacks(rep) -> bool:
    """No site fell back, but the joint value projections' at batch 2 (each half's rows are strided there), for that
    reason only (the tiny configs' text lengths keep the halves aligned), and the float16 hand-offs of the streams
    diffusers clips."""
    return all(s.fallback == 0 or (s.op == "linear_cat" and set(s.reasons) == {BATCH_REASON}) or clipped_refusal(s)
               for s in rep.sites)


@torch.no_grad()
def run(model, inputs):
    return model(**inputs).sample


def graph_stats(model):
    return fp.report(model).models[0].graphs


def pool_segments(handle):
    return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(handle)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_flux_replays_equal_eager_at_two_resolutions_and_batch2(dtype, unpatch_after):
    model = build_flux_transformer("flux-tiny", dtype, "cuda", seed=11)
    configs = [dict(batch=1, grid=(8, 8), txt_tokens=16), dict(batch=1, grid=(16, 24), txt_tokens=16), dict(batch=2, grid=(8, 8), txt_tokens=9)]
    cases = [(cfg, flux_transformer_inputs(model, seed=10 * i + s, **cfg)) for i, cfg in enumerate(configs) for s in (1, 2, 3)]
    refs = [run(model, inputs) for _, inputs in cases]
    assert all(r.std() > 0.01 for r in refs) and not torch.equal(refs[0], refs[1])

    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    for (_, inputs), ref in zip(cases, refs):
        assert torch.equal(run(model, inputs), ref)
    stats = graph_stats(model)
    assert stats["status"] == "on" and stats["captured"] == 3 and stats["replays"] == 6 and stats["eager"] == {}
    assert stats["pool_mib"] > 0
    rep = fp.report(model)
    assert rep.fast > 0 and only_batch_fallbacks(rep), str(rep)  # the captured forward ran the fused kernels

    # The replay writes every output element: poison the static outputs, then replay.
    for graph in model.__dict__[GRAPHS_ATTR].graphs.values():
        for out in graph.outputs:
            out.fill_(float("nan"))
    for (_, inputs), ref in zip(cases, refs):
        assert torch.equal(run(model, inputs), ref)


@pytest.fixture(scope="module")
def flux_dev():
    model = build_flux_transformer("flux-dev", torch.bfloat16, "cuda", seed=0)
    yield model
    del model
    torch.cuda.empty_cache()


def test_flux_dev_512_and_batch2_replays_are_bitwise_identical(flux_dev, unpatch_after):
    cases = [
        flux_transformer_inputs(flux_dev, grid=(32, 32), txt_tokens=512, seed=21),  # 512x512
        flux_transformer_inputs(flux_dev, grid=(32, 32), txt_tokens=512, seed=22),
        flux_transformer_inputs(flux_dev, batch=2, grid=(32, 32), txt_tokens=512, seed=23),
        flux_transformer_inputs(flux_dev, batch=2, grid=(32, 32), txt_tokens=512, seed=24),
    ]
    refs = [run(flux_dev, inputs) for inputs in cases]
    assert refs[0].std() > 0.01
    fp.patch(flux_dev, cuda_graphs=True)
    unpatch_after(flux_dev)
    for inputs, ref in zip(cases, refs):
        assert torch.equal(run(flux_dev, inputs), ref)
    stats = graph_stats(flux_dev)
    assert stats["captured"] == 2 and stats["replays"] == 2 and stats["eager"] == {}, stats
    model_bytes = sum(p.numel() * p.element_size() for p in flux_dev.parameters())
    assert 0 < stats["pool_mib"] * 2**20 < 0.1 * model_bytes, stats  # modest next to the model
    assert stats["static_inputs_mib"] > 8  # two signatures, each with a (B, 512, 4096) bf16 text input
    rep = fp.report(flux_dev)
    # the eager first call of each signature counts its fused sites; replays run no Python
    assert len(rep.sites) == 547 and only_batch_fallbacks(rep), str(rep)
    print(f"flux-dev 512x512 graphs: {stats}")


def test_changed_position_ids_with_the_same_shapes_give_the_eager_result(unpatch_after):
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=12)
    a = flux_transformer_inputs(model, grid=(8, 12), txt_tokens=16, seed=1)
    b = dict(a, img_ids=a["img_ids"].flip(0).contiguous(), txt_ids=torch.arange(48.0, device="cuda").reshape(16, 3))
    shifted = a["img_ids"].clone()
    shifted[:, 1] += 5
    ref_a, ref_b, ref_shifted = run(model, a), run(model, b), run(model, dict(a, img_ids=shifted))
    assert not torch.equal(ref_a, ref_b) and not torch.equal(ref_a, ref_shifted)

    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    assert torch.equal(run(model, a), ref_a)  # eager, then capture
    assert torch.equal(run(model, a), ref_a)  # replay
    assert torch.equal(run(model, b), ref_b)  # replay with other ids of the same shapes
    assert torch.equal(run(model, a), ref_a)
    a["img_ids"][:, 1] += 5  # the same tensor, changed in place
    assert torch.equal(run(model, a), ref_shifted)
    stats = graph_stats(model)
    assert stats["captured"] == 1 and stats["replays"] == 4 and stats["eager"] == {}


def test_a_value_derived_from_an_input_is_computed_by_the_graph(unpatch_after):
    """A layer that derives a value from a forward input through `_rope_cache.derived` (kept on the input tensor, here
    a static input buffer): the warm-up's value must not be what the capture reads (same buffer, same version
    counter, and CPython may give the capture's forward the warm-up's frame id), else every replay with other inputs
    would add the first inputs' value. Companion of test_graphs.py's probe, with a real capture."""
    from diffusers_fastpath.models import _rope_cache

    class DerivesFromItsInput(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + _rope_cache.derived(x, "test-mean", lambda: x.mean())

    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=13)
    model.x_embedder.__class__ = DerivesFromItsInput
    cases = [flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=s) for s in (1, 2, 3)]
    for k, inputs in enumerate(cases):  # latents of other means
        inputs["hidden_states"] += k
    refs = [run(model, inputs) for inputs in cases]
    assert not torch.equal(refs[0], refs[1])

    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    for i in (0, 1, 2, 0, 1):  # eager then capture, then replays with other inputs
        assert torch.equal(run(model, cases[i]), refs[i]), i
    stats = graph_stats(model)
    assert stats["captured"] == 1 and stats["replays"] == 4 and stats["eager"] == {}


def test_weight_changes_between_calls_are_picked_up(unpatch_after):
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=13)
    twin = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=13)  # the unpatched reference
    inputs = flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=2)
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    runner = model.__dict__[GRAPHS_ATTR]
    before = run(model, inputs)
    assert torch.equal(before, run(twin, inputs)) and torch.equal(run(model, inputs), before)

    new = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=14).state_dict()
    model.load_state_dict(new)  # in place: the graph reads the new values
    twin.load_state_dict(new)
    out = run(model, inputs)
    assert torch.equal(out, run(twin, inputs)) and not torch.equal(out, before)
    assert runner.invalidations == 0

    keep = [p.data for p in model.parameters()]  # keeps the old storages alive: the round trip must move them
    model.to("cpu").to("cuda")
    del keep
    assert torch.equal(run(model, inputs), run(twin, inputs))
    assert runner.invalidations == 1

    replaced = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=15).state_dict()
    model.load_state_dict(replaced, assign=True)  # new Parameter objects
    twin.load_state_dict(replaced)
    assert torch.equal(run(model, inputs), run(twin, inputs))
    assert runner.invalidations == 2 and graph_stats(model)["eager"] == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_pipeline_generation_with_graphs_is_md5_identical(dtype, unpatch_after):
    pipe = tiny_flux_pipeline(dtype=dtype, device="cuda", seed=3)
    pipe.set_progress_bar_config(disable=True)
    emb = prompt_embeddings(pipe, txt_tokens=16)

    def generate():
        gen = torch.Generator("cuda").manual_seed(0)
        out = pipe(**emb, height=128, width=128, num_inference_steps=4, generator=gen, output_type="np")
        return hashlib.md5(out.images.tobytes()).hexdigest()

    ref = generate()
    fp.patch(pipe, cuda_graphs=True)
    unpatch_after(pipe)
    assert generate() == ref
    assert generate() == ref  # every step a replay
    stats = graph_stats(pipe.transformer)  # (the pipeline's VAE is patched too, its forward unused)
    assert stats["captured"] == 1 and stats["replays"] == 3 + 4 and stats["eager"] == {}, stats
    assert "cuda graphs: on; 1 captured, 7 replays" in str(fp.report(pipe))


def test_ernie_image_replays_equal_eager(unpatch_after):
    model = build_ernie_image_transformer("ernie-image-tiny", torch.bfloat16, "cuda", seed=5)
    cases = [
        ernie_image_inputs(model, batch=2, grid=(8, 8), text_lens=(12, 5), seed=1),
        ernie_image_inputs(model, batch=2, grid=(8, 8), text_lens=(5, 12), seed=2),  # same shapes, other lengths
        ernie_image_inputs(model, batch=1, grid=(16, 12), text_lens=(7,), seed=3),
    ]
    refs = [run(model, inputs) for inputs in cases]
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    for inputs, ref in zip(cases, refs):
        assert torch.equal(run(model, inputs), ref)
    stats = graph_stats(model)
    assert stats["captured"] == 2 and stats["replays"] == 1 and stats["eager"] == {}, stats
    rep = fp.report(model)
    assert rep.fast > 0 and rep.fallback == 0, str(rep)


class SyncingProcessor(FluxAttnProcessor):
    """Reads a value on the host in every call: eager is fine, a CUDA graph capture is not."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        float(hidden_states.abs().max())
        return super().__call__(attn, hidden_states, *args, **kwargs)


def test_a_forward_that_cannot_be_captured_runs_eager(unpatch_after, fastpath_log):
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=16)
    model.transformer_blocks[0].attn.set_processor(SyncingProcessor())
    cases = [flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=s) for s in (1, 2, 3)]
    refs = [run(model, inputs) for inputs in cases]
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    for inputs, ref in zip(cases, refs):
        assert torch.equal(run(model, inputs), ref)
    stats = graph_stats(model)
    assert stats["captured"] == 0 and stats["status"] == "on"
    (reason, count), = stats["eager"].items()
    assert reason.startswith("capture failed") and count == 2, stats
    warnings = [r.getMessage() for r in fastpath_log.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "could not capture a CUDA graph" in warnings[0]
    assert all(op.disabled is None for op in OPS.values())  # a failed capture disables no fused op
    # the failed capture left the device's random generator usable (its capture-mode state is put back)
    assert torch.randn(4, device="cuda").isfinite().all()
    build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=18)  # random init on the device


def test_unpatch_frees_the_graph_pool():
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=17)
    inputs = flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=1)
    fp.patch(model, cuda_graphs=True)
    run(model, inputs)
    run(model, inputs)
    handle = model.__dict__[GRAPHS_ATTR].pool[1]
    assert pool_segments(handle)
    fp.unpatch(model)
    assert "forward" not in vars(model) and GRAPHS_ATTR not in vars(model)
    gc.collect()
    torch.cuda.empty_cache()
    assert pool_segments(handle) == []


def test_a_forward_wrapped_after_patch_pauses_real_graphs_and_they_resume(unpatch_after):
    """A library's per-instance wrapper with per-call state (as cache-dit's; see test_graphs.wrap_like_a_cache): while
    it is in place no capture runs through it (its state advances once per call, the outputs equal the unpatched
    twin's under the same wrapper); once it puts the forward back (bound again), real graphs capture and replay."""
    from test_graphs import unwrap_like_a_cache, wrap_like_a_cache

    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=19)
    twin = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=19)
    cases = [flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=s) for s in (1, 2, 3)]
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    steps, steps_ref = wrap_like_a_cache(model), wrap_like_a_cache(twin)
    for inputs in cases:
        assert torch.equal(run(model, inputs), run(twin, inputs))
    stats = graph_stats(model)
    assert steps.steps == steps_ref.steps == 3 and stats["captures"] == 0 and stats["status"].startswith("paused: ")
    unwrap_like_a_cache(model)
    unwrap_like_a_cache(twin)
    for inputs in cases:
        assert torch.equal(run(model, inputs), run(twin, inputs))
    stats = graph_stats(model)
    assert stats["status"] == "on" and stats["captured"] == 1 and stats["replays"] == 2, stats


class ScaledByConstants(torch.nn.Module):
    """Builds small tensors from Python values on the GPU in its forward (as LTX-2's rotary coordinates do)."""

    def __init__(self, n: int = 3):
        super().__init__()
        self.factors = [8.0, 32.0, 32.0] if n == 3 else [float(i) for i in range(n)]

    def forward(self, x):
        scale = torch.tensor(self.factors, device=x.device)
        offset = torch.tensor([i % 5 for i in range(len(self.factors))], dtype=torch.int64, device=x.device)
        return x * scale + offset


def test_small_host_constants_are_captured_as_fills():
    """``torch.tensor(values, device=cuda)`` in a captured forward: captured (as fills), each replay equal to eager
    on new inputs; a constant of more than MAX_ELEMENTS values still fails the capture (a pageable copy)."""
    from diffusers_fastpath._host_constants import MAX_ELEMENTS
    from diffusers_fastpath.graphs import CudaGraphs

    graphs = CudaGraphs()
    module = ScaledByConstants()
    static = torch.randn(4, 3, device="cuda")
    real = torch.tensor
    graph, out = graphs.record(graphs.new_pool(static.device), lambda: module(static))
    assert torch.tensor is real  # torch's own again after the capture
    for seed in range(3):
        static.copy_(torch.randn(4, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, module(static))
    big = ScaledByConstants(MAX_ELEMENTS + 1)
    wide = torch.randn(2, MAX_ELEMENTS + 1, device="cuda")
    with pytest.raises(RuntimeError, match="pinned|capture"):
        graphs.record(graphs.new_pool(wide.device), lambda: big(wide))
    assert torch.randn(4, device="cuda").isfinite().all()


def test_ltx2_is_captured_and_its_replays_equal_eager(unpatch_after):
    """LTX-2 (tiny config): its forward builds its rotary coordinates' scale factors and patch sizes with
    ``torch.tensor(..., device=cuda)``, which failed every capture before; now captured, replays bit-identical."""
    from diffusers_fastpath.testing import zoo

    model = zoo.build("ltx2", dtype=torch.bfloat16, device="cuda")
    cases = [zoo.inputs("ltx2", model, seed=s) for s in (1, 2, 3)]
    with torch.no_grad():
        refs = [model(**inputs)[0].clone() for inputs in cases]
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    with torch.no_grad():
        for inputs, ref in zip(cases, refs):
            assert torch.equal(model(**inputs)[0], ref)
    stats = graph_stats(model)
    assert stats["captured"] == 1 and stats["replays"] == 2 and stats["eager"] == {}, stats
