"""The checks every family's tests run (on a CPU with the kernels emulated, and on the GPU at full size): patched ==
unpatched bit for bit, every site on its fast path, a patch round trip (unpatch, pickle, state dict), fullgraph
compilation, a pipeline generation md5-identical."""

from __future__ import annotations

import collections
import contextlib
import hashlib

import torch
from torch.utils import _pytree as pytree


def assert_every_site_fast(report, counts: dict[str, int], calls: dict, forwards: int = 1,
                           refused: dict[str, str] | None = None, models: set[str] | None = None) -> None:
    """`report` (of one model, or of the `models` it names) has `counts` sites per op, and each took its fast path
    ``calls[op]`` (default 1; a tuple: any of those) times per forward on each of `forwards` forwards, never falling
    back; except the ops in `refused`, whose sites fell back on every call, all for the reason given (the joint value
    projections at batch 2, say)."""
    sites = [s for s in report.sites if models is None or s.model in models]
    assert collections.Counter(s.op for s in sites) == counts, str(report)
    assert all(site_ok(s, calls, forwards, refused) for s in sites), str(report)


def assert_vae_decoded_once_fast(report) -> None:
    """The pipeline's VAE (patched with it, `models.vae_kl`) decoded once: each decoder site fast once, the encoder's
    idle (text-to-image encodes nothing), none falling back."""
    sites = [s for s in report.sites if s.model == "vae"]
    decoding = ("decoder.", "post_quant_conv")  # (FLUX.2's VAE convolves the latents before its decoder)
    assert all(s.fallback == 0 and s.fast == (1 if s.site.startswith(decoding) else 0) for s in sites), str(report)


def ltx_vae_sites(report) -> list:
    """`report`'s sites (an LTX VAE's), less the ``conv_bias`` site of each causal convolution's ``.conv`` whose
    ``ltx_causal_conv3d`` (or a chain op: LTX-2's ``ltx_norm_conv`` or ``ltx_bias_norm_conv``, LTX-Video's
    ``ltx_vae_rmsnorm_conv``) ran fast and which fell back nowhere: the channels-last path adds the bias itself, so that
    site counts only the calls of the first-call checks (the module's forward) and of the channels-first path; and less
    the sites that a fast chain stands for and that never ran: its convolution's ``ltx_causal_conv3d``, the norms'
    sites of its block (the norm -> SiLU pair's, and LTX-Video's norm-alone ``ltx_rmsnorm``), and of the two chain ops
    of one convolution the one its calls did not take (``ltx_bias_norm_conv`` where the value came as a tensor, as the
    first call of each signature of the convolution before it leaves it; ``ltx_norm_conv`` where it always came
    pending); and less a block's ``conv_bias_residual`` site that never ran (its add's value came as a tensor: the
    first call of each signature of the convolution before it, or a convolution whose channels leave nothing
    pending); and less the ``ltx_causal_conv3d`` site of a fast upsampler's convolution (`ltx_upsampler3d` stands
    for its call: that site counts only the calls of the upsampler's first-call checks, the module's forward)."""
    chains = ("ltx_norm_conv", "ltx_bias_norm_conv", "ltx_vae_rmsnorm_conv")
    norms = ("per_channel_rmsnorm_silu", "ltx_vae_rmsnorm_silu", "ltx_rmsnorm")
    chain = {r.site.split(":")[0] for r in report.sites if r.op in chains and r.fast}
    upsampled = {f"{r.site.split(':')[0]}.conv" for r in report.sites if r.op == "ltx_upsampler3d" and r.fast}
    fast = {r.site for r in report.sites if r.op == "ltx_causal_conv3d" and r.fast} | chain | upsampled
    blocks = {path.rsplit(".", 1)[0] for path in chain}

    def left_out(r) -> bool:
        path = r.site.split(":")[0]
        if r.fallback:
            return False
        if r.op == "conv_bias":
            return path.rsplit(".", 1)[0] in fast
        if r.op == "ltx_causal_conv3d" and path in upsampled:
            return True
        return not r.fast and (r.op in ("ltx_causal_conv3d", *chains) and path in chain
                               or r.op in norms and path.rsplit(".", 1)[0] in blocks
                               or r.op == "conv_bias_residual")

    return [r for r in report.sites if not left_out(r)]


def site_ok(site, calls: dict, forwards: int = 1, refused: dict[str, str] | None = None) -> bool:
    """One site of a report took its fast path ``calls[op]`` times (default 1; a tuple: any of those) per forward on
    each of `forwards` forwards, never falling back; or, for an op in `refused`, fell back that often, all for the
    reason given."""
    n = calls.get(site.op, 1)
    expected = {c * forwards for c in (n if isinstance(n, tuple) else (n,))}
    if refused and site.op in refused:
        return site.fast == 0 and set(site.reasons) == {refused[site.op]} and site.fallback in expected
    return site.fast in expected and site.fallback == 0


def clipped_refusal(site) -> bool:
    """A hand-off site (`diffusers_fastpath.models._handoff`) of a float16 stream that diffusers clips between blocks
    (FLUX.1's text stream, its single blocks'): refused on every call, for that reason only."""
    from ..models._handoff import GATED_MODULATE, REASON_FP16

    return site.op == GATED_MODULATE and site.fast == 0 and set(site.reasons) == {REASON_FP16}


def outputs_equal(a, b) -> bool:
    """`torch.equal` of two model outputs: tensors, or lists of them (Z-Image returns one tensor per sample)."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(outputs_equal, a, b))
    return isinstance(b, torch.Tensor) and torch.equal(a, b)


def _flat(out) -> torch.Tensor:
    return torch.cat([o.flatten() for o in out]) if isinstance(out, (list, tuple)) else out


def assert_patched_equals_unpatched(build, make_inputs, counts: dict[str, int], dtype=torch.bfloat16, seed: int = 1,
                                    **input_kwargs) -> None:
    """The CPU check every family runs first: two models ``build(dtype=dtype, seed=seed)`` (the same random weights),
    fresh inputs ``make_inputs(model, seed=seed + 1, **input_kwargs)``, the patched model's output `torch.equal` to
    the unpatched one's (a real-looking output: finite, not zeros) and `report`'s sites per op equal to `counts`;
    the model is unpatched again afterwards."""
    from .. import patch, report, unpatch

    ref_model, model = build(dtype=dtype, seed=seed), build(dtype=dtype, seed=seed)
    inputs = make_inputs(model, seed=seed + 1, **input_kwargs)
    with torch.no_grad():
        ref = ref_model(**inputs).sample
        assert torch.isfinite(_flat(ref)).all() and _flat(ref).float().std() > 0.1
        patch(model)
        try:
            assert outputs_equal(model(**inputs).sample, ref)
            found = collections.Counter(s.op for s in report(model).sites)
            assert found == counts, f"sites {dict(found)}, expected {counts}"
        finally:
            unpatch(model)


def assert_patched_step_exact_and_fused(model, inputs: dict, counts: dict[str, int], calls: dict[str, int]) -> None:
    """The check every family runs, on a CPU with the kernels emulated and on the GPU at full size: one forward of
    `model` (real-looking output, not zeros), then patched into an output poisoned with NaN first is `torch.equal`
    to it, with every site fast (`assert_every_site_fast`); `model` is unpatched again afterwards."""
    from .. import patch, report, unpatch

    with torch.no_grad():
        ref = model(**inputs).sample
        assert torch.isfinite(_flat(ref)).all() and _flat(ref).float().std() > 0.01
        patch(model)
        try:
            got = model(**inputs).sample
            out = [torch.full_like(g, float("nan")) for g in got] if isinstance(got, list) else torch.full_like(got, float("nan"))
            for o, g in zip(out, got) if isinstance(got, list) else [(out, got)]:
                o.copy_(g)
            assert outputs_equal(out, ref)
            assert_every_site_fast(report(model), counts, calls)
        finally:
            unpatch(model)


@contextlib.contextmanager
def state_dict_round_trip(model):
    """The reversibility checks the VAEs' CPU tests share, around a block where `model` is patched (for the family's
    own checks of what was swapped in): patching keeps the state dict, keys and values, and the state dict loads back
    into the patched modules; on leaving, ``unpatch`` gives every module its class back and leaves no attribute of
    this package behind."""
    from .. import patch, unpatch

    classes = {name: type(m) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patch(model)
    yield classes
    patched = model.state_dict()
    assert patched.keys() == state.keys() and all(torch.equal(patched[k], v) for k, v in state.items())
    model.load_state_dict(state)  # loads into the patched modules
    unpatch(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert not [name for name, m in model.named_modules() if any(k.startswith("_fastpath") for k in vars(m))]


@contextlib.contextmanager
def patch_round_trip(model, inputs: dict):
    """The reversibility checks every family's CPU tests share, around a block where `model` is patched (for the
    family's own checks of what was swapped in): patching keeps the state dict, keys and values; a pickle of the
    patched model loads patched and computes the same output; on leaving, ``unpatch`` gives every module its class
    back and leaves no attribute of this package behind."""
    import pickle

    from .. import patch, unpatch

    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    patch(model)
    loaded = None
    try:
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
        loaded = pickle.loads(pickle.dumps(model))  # loads patched: the swapped-in classes are found by name
        assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
        with torch.no_grad():
            assert outputs_equal(loaded(**inputs).sample, model(**inputs).sample)
        yield model
    finally:
        if loaded is not None:
            unpatch(loaded)
        unpatch(model)
    assert [type(m) for m in model.modules()] == types
    assert not any(k.startswith("_fastpath") for m in model.modules() for k in vars(m))


def assert_compiles_fullgraph_exactly(model, inputs: dict) -> None:
    """Patched `model` traces with ``torch.compile(fullgraph=True)`` (no graph break) and the compiled call is
    `torch.equal` to the unpatched eager output; `model` is unpatched again afterwards."""
    from .. import patch, unpatch

    with torch.no_grad():
        ref = model(**inputs).sample
        patch(model)
        try:
            assert outputs_equal(torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs).sample, ref)
        finally:
            unpatch(model)


def _md5(t: torch.Tensor) -> str:
    """md5 of a tensor's values as fp32 bytes (the generation checks' digest)."""
    return hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()


def assert_pipeline_generation_exact_and_fused(pipe, call: dict, idle: tuple[str, ...] = (),
                                               every_site: bool = True) -> None:
    """A generation of `pipe` (3 steps at 128x128 unless `call` says otherwise; CFG as `call` asks) patched is
    md5-identical to unpatched on the latents, with every site of every patched denoiser taking its fast path (on a
    CPU: under emulated kernels) and never falling back (the VAE, which a latent output never calls, aside); `pipe` is unpatched again afterwards. The sites of the ops
    in `idle` only count a fused op's fallback (``rotary_emb`` where the QK norm and the rotary run as one op): they
    must not fall back, and take no fast call either. With `every_site` false, sites the model never reaches may
    stay at zero (SD3's last block has no context gates to run), as long as each op ran fast somewhere."""
    from .. import patch, report, unpatch

    pipe.set_progress_bar_config(disable=True)

    call = dict(dict(height=128, width=128, num_inference_steps=3), **call)

    def generate():
        out = pipe(**call, generator=torch.Generator().manual_seed(1), output_type="latent")
        latents = out.frames if hasattr(out, "frames") else out.images  # video pipelines return frames
        return _md5(latents)

    ref = generate()
    patch(pipe)
    try:
        assert generate() == ref
        # (the latents are the output: the VAE, patched with the pipeline, is never called)
        sites = [s for s in report(pipe).sites if s.model != "vae"]
        reached = {s.op for s in sites if s.fast > 0}
        assert sites and all((s.fast == 0 if s.op in idle else (s.fast > 0 or not every_site and s.op in reached))
                             and s.fallback == 0 for s in sites), str(report(pipe))
    finally:
        unpatch(pipe)


def generation_latents_and_image(pipe, call: dict, steps: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One generation of `pipe` (``size`` x ``size``, `steps` steps, a fixed seed): its final latents (captured by a
    step-end callback of the same call, before unpacking) and its decoded image (``output_type="pt"``)."""
    captured = {}

    def on_step_end(pipe, i, t, kwargs):
        captured["latents"] = kwargs["latents"]
        return {}

    image = pipe(**call, height=size, width=size, num_inference_steps=steps, generator=torch.Generator().manual_seed(1),
                 output_type="pt", callback_on_step_end=on_step_end).images
    return captured["latents"], image


def assert_generation_and_image_exact_and_fused(pipe, call: dict, counts: dict[str, int], calls: dict, steps: int,
                                                size: int, forwards_per_step: int = 1) -> None:
    """`pipe`'s generation patched is md5-identical to unpatched on the final latents and on the decoded image (a
    real-looking one: finite, not flat), with `counts` sites, each fast ``calls[op]`` times on every one of the
    ``steps * forwards_per_step`` transformer forwards (2 a step for a pipeline that runs its negative prompt as a
    forward of its own); `pipe` is unpatched again afterwards. (`assert_pipeline_generation_exact_and_fused`
    compares the latents alone, for any pipeline and site layout.)"""
    from .. import patch, report, unpatch

    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_image = generation_latents_and_image(pipe, call, steps, size)
    for ref in (ref_latents, ref_image):
        assert torch.isfinite(ref).all() and ref.float().std() > 0.01
    patch(pipe)
    try:
        latents, image = generation_latents_and_image(pipe, call, steps, size)
        assert torch.equal(latents, ref_latents) and _md5(latents) == _md5(ref_latents)
        assert torch.equal(image, ref_image) and _md5(image) == _md5(ref_image)
        rep = report(pipe)
        denoisers = {m.name for m in rep.models} - {"vae"}
        assert_every_site_fast(rep, counts, calls, forwards=steps * forwards_per_step, models=denoisers)
        assert_vae_decoded_once_fast(rep)
    finally:
        unpatch(pipe)


class SimulatedGraphs:
    """A CPU stand-in for `graphs.CudaGraphs` with a CUDA graph's memory semantics: `record` runs the forward once
    and keeps its outputs as the static outputs; a replay runs it again on the static inputs and writes the result
    into those same output tensors, as a graph replay overwrites its output memory. (Unlike a real graph it runs
    Python on replay, so the RoPE-cache and stale-weights hazards are tested on the GPU.) ``skew`` adds to every
    replayed output, to provoke a verification mismatch; ``fail`` makes the capture raise."""

    device_type = "cpu"

    def __init__(self, skew: float = 0.0, fail: Exception | None = None) -> None:
        self.skew, self.fail, self.pools, self.recorded = skew, fail, 0, 0

    def new_pool(self, device):
        self.pools += 1
        return ("pool", self.pools)

    def record(self, pool, fn):
        if self.fail is not None:
            raise self.fail
        self.recorded += 1
        out = fn()
        skew = self.skew

        class Replay:
            def replay(self):
                for static, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(fn())):
                    static.copy_(new + skew)

        return Replay(), out

    def pool_bytes(self, pool):
        return 0


class TracedGraphs:
    """A CPU stand-in for `graphs.CudaGraphs` that, like a real CUDA graph, runs no Python on replay: `record` traces
    the forward into aten ops (``make_fx``), which keep every tensor the forward read (static inputs, weights, tensors
    a module holds) by reference and bake in every Python decision and scalar argument (an ``eps``, a ``theta``); a
    replay runs those ops and writes into the static outputs. So a graph the runner should have dropped gives the
    stale number here, as on a GPU (`SimulatedGraphs` reruns the forward and cannot show that)."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.pools, self.recorded = 0, 0

    def new_pool(self, device):
        self.pools += 1
        return ("pool", self.pools)

    def record(self, pool, fn):
        self.recorded += 1
        fn()  # the warm-up, as `CudaGraphs.record` runs it
        return traced_graph(fn)

    def pool_bytes(self, pool):
        return 0


def traced_graph(fn):
    """``(replay, static outputs)`` of `fn` traced into aten ops (`TracedGraphs`): a replay runs those ops, no
    Python, and writes into the static outputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    held = {}

    def traced():
        leaves, held["spec"] = pytree.tree_flatten(fn())
        held["leaves"] = leaves
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    gm = make_fx(traced, tracing_mode="real")()
    outs = [t.clone() for t in gm()]
    it = iter(outs)
    static = pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in held["leaves"]],
                                   held["spec"])

    class Replay:
        def replay(self):
            for out, new in zip(outs, gm()):
                out.copy_(new)

    return Replay(), static
