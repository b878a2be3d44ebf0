"""CUDA graphs (`patch(..., cuda_graphs=True)`) on CPU: the switch, the signature and fingerprint logic, and the
runner's logic against a simulated graph backend. Real captures and replays are in `test_graphs_gpu.py`."""

from __future__ import annotations

import copy

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath import graphs
from diffusers_fastpath.graphs import GRAPHS_ATTR, ModelFingerprint, Unsupported, call_signature
from diffusers_fastpath._state import STATE_ATTR
from diffusers_fastpath.models import _rope_cache
from diffusers_fastpath.testing import SimulatedGraphs, build_flux_transformer, flux_transformer_inputs

NAMES = ("hidden_states", "encoder_hidden_states", "timestep", "joint_attention_kwargs", "return_dict", "samples")
CPU = torch.device("cpu")


def snapshot(model):
    """Everything unpatch must restore: module types, instance attributes (forward included), processors, hooks."""
    return [
        (name, type(m), sorted(vars(m)), getattr(m, "processor", None), dict(m._forward_hooks), dict(m._forward_pre_hooks))
        for name, m in model.named_modules()
    ]


def eager(model, inputs, **extra):
    with torch.no_grad():
        return model(**inputs, **extra)


@pytest.fixture
def simulated(unpatch_after):
    """A patched tiny FLUX whose forward goes through a GraphRunner with `SimulatedGraphs`, and its eager twin."""

    def make(backend=None, dtype=torch.float32):
        model = build_flux_transformer("flux-tiny", dtype, seed=4)
        twin = build_flux_transformer("flux-tiny", dtype, seed=4)
        fp.patch(model)
        unpatch_after(model)
        runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", backend or SimulatedGraphs())
        return model, twin, runner

    return make


# --- the switch --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA behaviour")
def test_cuda_graphs_without_cuda_is_a_noop_with_a_reason(fastpath_log):
    model = build_flux_transformer("flux-tiny", torch.float32, seed=1)
    inputs = flux_transformer_inputs(model, seed=2)
    ref = eager(model, inputs).sample
    before = snapshot(model)
    fp.patch(model, cuda_graphs=True)
    assert "forward" not in vars(model)  # nothing hooked
    assert torch.equal(eager(model, inputs).sample, ref)
    graphs_row = fp.report(model).models[0].graphs
    assert graphs_row["status"] == "off: CUDA is not available" and graphs_row["replays"] == 0
    assert "cuda graphs: off: CUDA is not available" in str(fp.report(model))
    lines = [r.getMessage() for r in fastpath_log.records if "cuda_graphs" in r.getMessage()]
    assert lines == ["diffusers_fastpath: cuda_graphs=True has no effect on FluxTransformer2DModel: CUDA is not available; it runs eager"]
    fp.unpatch(model)
    assert snapshot(model) == before


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_cuda_graphs_must_be_a_bool(value):
    model = build_flux_transformer("flux-tiny", torch.float32)
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        fp.patch(model, cuda_graphs=value)
    assert STATE_ATTR not in vars(model)


def test_graphs_can_be_asked_for_on_an_already_patched_model(simulated):
    model = build_flux_transformer("flux-tiny", torch.float32)
    fp.patch(model)
    assert GRAPHS_ATTR not in vars(model)
    fp.patch(model, cuda_graphs=True)
    assert GRAPHS_ATTR in vars(model)
    fp.unpatch(model)
    assert GRAPHS_ATTR not in vars(model) and "forward" not in vars(model)


def test_no_report_row_without_cuda_graphs():
    model = fp.patch(build_flux_transformer("flux-tiny", torch.float32))
    assert fp.report(model).models[0].graphs == {} and "cuda graphs" not in str(fp.report(model))
    fp.unpatch(model)


# --- signatures --------------------------------------------------------------------------------------------------


def test_signature_is_the_same_by_position_or_keyword():
    x, y, t = torch.randn(2, 16, 4), torch.randn(2, 8, 32), torch.rand(2)
    by_position, tensors1 = call_signature(NAMES, (x, y, t), {}, CPU)
    by_keyword, tensors2 = call_signature(NAMES, (), dict(timestep=t, hidden_states=x, encoder_hidden_states=y), CPU)
    assert by_position == by_keyword and hash(by_position) == hash(by_keyword)
    assert all(a is b for a, b in zip(tensors1, tensors2)) and [id(a) for a in tensors1] == [id(x), id(y), id(t)]


def test_signature_tells_apart_what_changes_the_kernels():
    x = torch.randn(2, 16, 4)
    base, _ = call_signature(NAMES, (x,), {}, CPU)
    variants = [
        (torch.randn(1, 16, 4),),  # batch
        (torch.randn(2, 32, 4),),  # resolution
        (x.to(torch.bfloat16),),  # dtype
        (torch.randn(2, 4, 16).transpose(1, 2),),  # strides
    ]
    sigs = {base} | {call_signature(NAMES, v, {}, CPU)[0] for v in variants}
    assert len(sigs) == 5
    # present-but-None, absent, and plain values by value (and by type: True == 1 but is not the same constant)
    a = call_signature(NAMES, (x,), dict(joint_attention_kwargs=None), CPU)[0]
    b = call_signature(NAMES, (x,), dict(return_dict=False), CPU)[0]
    c = call_signature(NAMES, (x,), dict(return_dict=True), CPU)[0]
    d = call_signature(NAMES, (x,), dict(return_dict=1), CPU)[0]
    assert len({base, a, b, c, d}) == 5
    # values of tensors are not part of it: new inputs of the same layout reuse the graph
    assert call_signature(NAMES, (torch.randn(2, 16, 4),), {}, CPU)[0] == base


def test_signature_holds_every_setting_that_picks_kernels():
    """A graph bakes in the kernels chosen at capture: every process-wide switch that chooses them is in the key."""
    switches = {
        "allow_fp16_bf16_reduction_math_sdp": (torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed,
                                               torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp),
        "matmul.allow_fp16_accumulation": (lambda: torch.backends.cuda.matmul.allow_fp16_accumulation,
                                           lambda v: setattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", v)),
        "cudnn.deterministic": (lambda: torch.backends.cudnn.deterministic,
                                lambda v: setattr(torch.backends.cudnn, "deterministic", v)),
        "cudnn.benchmark": (lambda: torch.backends.cudnn.benchmark,
                            lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
        "cudnn.enabled": (lambda: torch.backends.cudnn.enabled, lambda v: setattr(torch.backends.cudnn, "enabled", v)),
    }
    missing = []
    for name, (get, set_) in switches.items():
        old, before = get(), graphs._global_state()
        set_(not old)
        try:
            if graphs._global_state() == before:
                missing.append(name)
        finally:
            set_(old)
    assert not missing


def test_signature_flattens_lists_of_tensors_in_order():
    blocks = [torch.randn(1, 4, 8) for _ in range(3)]
    sig, tensors = call_signature(NAMES, (torch.randn(1, 4, 8),), dict(samples=blocks), CPU)
    assert [id(t) for t in tensors[1:]] == [id(t) for t in blocks]
    assert sig != call_signature(NAMES, (torch.randn(1, 4, 8),), dict(samples=blocks[:2]), CPU)[0]


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(joint_attention_kwargs={"scale": 0.5}), "unsupported kwargs: joint_attention_kwargs with keys ['scale']"),
        (dict(samples=object()), "unsupported argument samples of type object"),
        (dict(encoder_hidden_states=torch.randn(2, 2, device="meta")), "input encoder_hidden_states is on meta"),
        (dict(unknown=1), "unexpected argument unknown"),
    ],
)
def test_signature_refuses_what_a_graph_cannot_stand_for(kwargs, reason):
    with pytest.raises(Unsupported, match=reason.replace("[", r"\[").replace("]", r"\]")):
        call_signature(NAMES, (torch.randn(2, 4),), kwargs, CPU)


def test_empty_kwargs_dict_is_fine():
    sig, _ = call_signature(NAMES, (torch.randn(2, 4),), dict(joint_attention_kwargs={}), CPU)
    assert sig[1] == ("joint_attention_kwargs", (dict,))


# --- the model fingerprint ---------------------------------------------------------------------------------------


def test_fingerprint_keeps_in_place_weight_writes_and_catches_replacements():
    model = build_flux_transformer("flux-tiny", torch.float32, seed=1)
    fingerprint = ModelFingerprint(model, "cpu")
    assert fingerprint.matches() and fingerprint.blocker is None and fingerprint.device == CPU
    assert len(fingerprint.tensors) == len(list(model.parameters())) + len(list(model.buffers()))

    new = build_flux_transformer("flux-tiny", torch.float32, seed=2).state_dict()
    model.load_state_dict(new)  # in place: a replay reads the new values from the same memory
    assert fingerprint.matches()

    changes = {
        "to(dtype)": lambda m: m.to(torch.float64),  # same Parameter objects, new storage
        "assign": lambda m: m.load_state_dict(new, assign=True),
        "new child": lambda m: setattr(m.transformer_blocks[0].attn, "to_q", torch.nn.Linear(32, 32)),
        "new parameter": lambda m: m.norm_out.register_parameter("extra", torch.nn.Parameter(torch.ones(1))),
        "processor": lambda m: m.transformer_blocks[0].attn.set_processor(type(m.transformer_blocks[0].attn.processor)()),
        "class": lambda m: setattr(m.proj_out, "__class__", type("MyLinear", (torch.nn.Linear,), {})),
        "hook": lambda m: m.single_transformer_blocks[1].register_forward_hook(lambda *a: None),
        "attribute": lambda m: setattr(m.transformer_blocks[1], "_diffusers_hook", object()),
        # plain values a forward reads, which a captured graph bakes in (a list changed in place too)
        "eps": lambda m: setattr(m.norm_out.norm, "eps", 0.5),
        "theta": lambda m: setattr(m.pos_embed, "theta", 500),
        "axes_dim in place": lambda m: m.pos_embed.axes_dim.__setitem__(0, 2),
    }
    for what, change in changes.items():
        model = build_flux_transformer("flux-tiny", torch.float32, seed=1)
        model.pos_embed.axes_dim = list(model.pos_embed.axes_dim)  # its own list (the config's may be shared)
        fingerprint = ModelFingerprint(model, "cpu")
        change(model)
        assert not fingerprint.matches(), what


# bitsandbytes' int8 linear as the fingerprint sees it (the package needs CUDA to import): its class name and module
_FAKE_BNB_INT8 = type("Linear8bitLt", (torch.nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})


@pytest.mark.parametrize(
    "change,blocker",
    [
        (lambda m: m.transformer_blocks[0].norm1.register_forward_pre_hook(lambda *a: None), "forward hooks on transformer_blocks.0.norm1"),
        (lambda m: setattr(m.context_embedder, "_hf_hook", object()), "accelerate hook on context_embedder"),
        (lambda m: _register_diffusers_hook(m.transformer_blocks[0]), "diffusers hook on transformer_blocks.0"),
        (lambda m: setattr(m.proj_out, "forward", lambda x: x), "proj_out.forward is replaced per instance"),
        (lambda m: m.to("meta"), "weights on meta"),
        (lambda m: setattr(m.transformer_blocks[1].ff.net[2], "__class__", _FAKE_BNB_INT8),
         "bitsandbytes int8 layer transformer_blocks.1.ff.net.2: its matmul cannot be captured"),
    ],
)
def test_fingerprint_names_what_keeps_graphs_off(change, blocker):
    model = build_flux_transformer("flux-tiny", torch.float32, seed=1)
    change(model)
    assert blocker in ModelFingerprint(model, "cpu").blocker
    assert "need one cuda device" in ModelFingerprint(build_flux_transformer("flux-tiny"), "cuda").blocker


def _register_diffusers_hook(module):
    from diffusers.hooks import HookRegistry, ModelHook

    HookRegistry.check_if_exists_or_initialize(module).register_hook(ModelHook(), "test_hook")


def test_an_empty_diffusers_hook_registry_keeps_graphs_on_and_a_later_hook_is_seen():
    """Pipelines wrap every transformer call in ``transformer.cache_context(...)``, which creates an empty
    HookRegistry on the model: nothing runs, so graphs stay on; a hook registered later invalidates."""
    model = build_flux_transformer("flux-tiny", torch.float32, seed=1)
    with model.cache_context("cond"):
        pass
    assert "_diffusers_hook" in model.__dict__
    fingerprint = ModelFingerprint(model, "cpu")
    assert fingerprint.blocker is None and fingerprint.matches()
    _register_diffusers_hook(model)
    assert not fingerprint.matches()
    assert "diffusers hook on the model" in ModelFingerprint(model, "cpu").blocker


# --- the runner, against simulated graphs ------------------------------------------------------------------------


def test_runner_replays_equal_eager_and_never_alias(simulated):
    model, twin, runner = simulated()
    first = flux_transformer_inputs(model, batch=2, seed=1)
    second = flux_transformer_inputs(model, batch=2, seed=2)
    out1 = eager(model, first).sample  # eager reference, then capture (and a verified replay)
    kept = out1.clone()
    out2 = eager(model, second).sample  # a replay
    out3 = eager(model, first).sample  # a replay with other values in the static inputs
    assert torch.equal(out1, eager(twin, first).sample) and torch.equal(out2, eager(twin, second).sample)
    assert torch.equal(out3, out1) and torch.equal(out1, kept)  # the second replay did not overwrite the first result
    assert out2.data_ptr() != out3.data_ptr()
    stats = fp.report(model).models[0].graphs
    assert stats["captured"] == 1 and stats["replays"] == 2 and stats["eager"] == {} and stats["captures"] == 1

    tuple_out = eager(model, first, return_dict=False)  # another signature: another graph
    assert isinstance(tuple_out, tuple) and torch.equal(tuple_out[0], out1)
    eager(model, flux_transformer_inputs(model, batch=1, grid=(2, 4), seed=3))
    assert len(runner.graphs) == 3 and runner.backend.pools == 1  # one pool for all graphs of the model


@pytest.mark.parametrize("change", ["eps", "theta"])
def test_a_value_a_graph_baked_in_changed_after_capture_is_recaptured(change, simulated):
    """With graphs that run no Python on replay (`TracedGraphs`, as CUDA graphs): a module's ``eps`` or the rotary's
    ``theta`` set after capture must not replay the graph that baked the old value in."""
    from diffusers_fastpath.testing import TracedGraphs

    model, twin, runner = simulated(TracedGraphs())
    a, b = flux_transformer_inputs(model, seed=1), flux_transformer_inputs(model, seed=2)
    assert torch.equal(eager(model, a).sample, eager(twin, a).sample)  # captured
    assert torch.equal(eager(model, b).sample, eager(twin, b).sample) and runner.replays == 1  # replayed
    for m in (model, twin):
        if change == "eps":
            m.norm_out.norm.eps = 0.5
        else:
            m.pos_embed.theta = 500
    for inputs in (b, a):
        assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    assert runner.invalidations == 1 and runner.replays == 2


def test_two_threads_of_one_signature_each_get_their_own_result(simulated):
    """A replay's static inputs and outputs are shared by every call of its signature: two threads calling with the
    same shapes (here both copied in before either replays, as the GIL may interleave them) must not get each
    other's result. The runner lets one call at a time through its graphs."""
    import threading

    from diffusers_fastpath.testing import TracedGraphs

    class MeetBeforeReplay(TracedGraphs):  # both threads copy their inputs in, then meet, then replay (if they can)
        def __init__(self):
            super().__init__()
            self.barrier, self.armed = threading.Barrier(2, timeout=3), False

        def record(self, pool, fn):
            replay, static = super().record(pool, fn)
            outer = self

            class Replay:
                def replay(self):
                    if outer.armed:
                        try:
                            outer.barrier.wait()
                        except threading.BrokenBarrierError:  # the other thread waits on the runner: as it should
                            pass
                    replay.replay()

            return Replay(), static

    backend = MeetBeforeReplay()
    model, twin, runner = simulated(backend, dtype=torch.bfloat16)
    a, b = flux_transformer_inputs(model, seed=1), flux_transformer_inputs(model, seed=2)  # one signature
    want = {"a": eager(twin, a).sample, "b": eager(twin, b).sample}
    assert torch.equal(eager(model, a).sample, want["a"])  # captured
    backend.armed = True
    got = {}
    threads = [threading.Thread(target=lambda k, x: got.__setitem__(k, eager(model, x).sample), args=(k, x))
               for k, x in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(got["a"], want["a"]) and torch.equal(got["b"], want["b"]) and runner.replays == 2


def test_runner_maps_inputs_by_name_whatever_the_call_order(simulated):
    model, twin, runner = simulated()
    # FluxPipeline's order, not the forward's; and positional hidden_states
    names = ["timestep", "pooled_projections", "encoder_hidden_states", "txt_ids", "img_ids"]
    cases = [flux_transformer_inputs(model, seed=s, txt_tokens=8) for s in (1, 2)]
    for inputs in cases:
        call = {name: inputs[name] for name in names}
        with torch.no_grad():
            out = model(inputs["hidden_states"], **call, return_dict=False)[0]
        assert torch.equal(out, eager(twin, inputs).sample)
    assert runner.replays == 1 and runner.stats()["captured"] == 1


def test_runner_runs_eager_with_reasons(simulated):
    model, twin, runner = simulated()
    inputs = flux_transformer_inputs(model, seed=1)
    ref = eager(twin, inputs).sample
    assert torch.equal(eager(model, inputs, joint_attention_kwargs={"scale": 1.0}).sample, ref)
    assert torch.equal(model(**inputs).sample, ref)  # grad enabled
    model.train()
    assert torch.equal(eager(model, inputs).sample, ref)
    model.eval()
    model.__dict__[STATE_ATTR].quality = "high"
    assert torch.equal(eager(model, inputs).sample, ref)
    model.__dict__[STATE_ATTR].quality = "lossless"
    stats = runner.stats()
    assert stats["eager"] == {
        "unsupported kwargs: joint_attention_kwargs with keys ['scale']": 1,
        graphs.REASON_GRAD: 1,
        graphs.REASON_TRAINING: 1,
        "quality 'high': CUDA graphs serve the lossless tier only": 1,
    }
    assert stats["captured"] == 0 and runner.backend.recorded == 0
    assert "eager calls: unsupported kwargs" in str(fp.report(model))


def test_runner_recaptures_after_weights_move_and_reads_in_place_writes(simulated):
    model, twin, runner = simulated()
    inputs = flux_transformer_inputs(model, seed=1)
    eager(model, inputs)
    new = build_flux_transformer("flux-tiny", torch.float32, seed=9).state_dict()
    model.load_state_dict(new)
    twin.load_state_dict(new)
    assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    assert runner.invalidations == 0 and runner.replays == 1  # same memory, new values: the graph reads them
    model.load_state_dict(build_flux_transformer("flux-tiny", torch.float32, seed=10).state_dict(), assign=True)
    twin.load_state_dict(model.state_dict())
    assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    assert runner.invalidations == 1 and runner.captures == 2 and runner.backend.pools == 2


def test_runner_disables_itself_for_good_on_a_mismatch(simulated, fastpath_log):
    model, twin, runner = simulated(SimulatedGraphs(skew=1.0))
    inputs = flux_transformer_inputs(model, seed=1)
    ref = eager(twin, inputs).sample
    for _ in range(3):
        assert torch.equal(eager(model, inputs).sample, ref)
    warnings = [r.getMessage() for r in fastpath_log.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "differed from the eager forward" in warnings[0]
    stats = runner.stats()
    assert stats["status"].startswith("disabled: the first replay") and stats["captured"] == 0
    assert stats["eager"] == {graphs.REASON_DISABLED: 2} and runner.pool is None


def test_runner_runs_a_signature_it_cannot_capture_eager(simulated, fastpath_log):
    model, twin, runner = simulated(SimulatedGraphs(fail=RuntimeError("operation not permitted when stream is capturing")))
    for seed in (1, 2):
        inputs = flux_transformer_inputs(model, seed=seed)
        assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    eager(model, flux_transformer_inputs(model, batch=2, seed=3))  # another signature: tried once more
    warnings = [r.getMessage() for r in fastpath_log.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "could not capture a CUDA graph" in warnings[0]
    reason = "capture failed: RuntimeError: operation not permitted when stream is capturing"
    (said, count), = runner.stats()["eager"].items()
    assert said.startswith(reason) and count == 1 and runner.captures == 2 and runner.stats()["status"] == "on"
    assert " (at checks.py:" in said and said.endswith(" in record)"), said  # where it was raised: the innermost frame outside torch


def test_unpatch_restores_the_forward_and_drops_the_graphs(simulated):
    model = build_flux_transformer("flux-tiny", torch.float32, seed=4)
    before = snapshot(model)
    fp.patch(model)
    runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", SimulatedGraphs())
    import inspect

    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    eager(model, flux_transformer_inputs(model, seed=1))
    assert runner.graphs
    fp.unpatch(model)
    assert snapshot(model) == before
    assert not runner.graphs and runner.pool is None and runner.fingerprint is None and runner.status == "off: unpatched"


# --- forwards replaced per instance by other libraries (issue 43, item 10) --------------------------------------


class StepCounter(torch.nn.Module):
    """A module whose output depends on how often it ran, like a cache's step counter: a forward run more often
    than it is called (to warm up, record, check a replay) gives other numbers."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.steps = inner, 0

    def forward(self, x):
        self.steps += 1
        return self.inner(x) * (1 + self.steps / 8)


def wrap_like_a_cache(model):
    """What cache-dit's ``enable_cache`` does to a transformer (1.5.3, ``CachedAdapter.mock_transformer``): keep the
    forward it finds, put a partial of a local function in its place that swaps a stateful module in for the call
    (``unittest.mock.patch.object``) and calls the kept forward."""
    import functools
    import unittest.mock

    counter, kept = StepCounter(model.proj_out), model.forward

    def cached_forward(self, *args, **kwargs):
        with unittest.mock.patch.object(self, "proj_out", counter):
            return kept(*args, **kwargs)

    model.forward = functools.update_wrapper(functools.partial(cached_forward, model), cached_forward)
    model._kept_forward = kept
    return counter


def unwrap_like_a_cache(model):
    """cache-dit's ``disable_cache``: the kept forward is bound again and put back."""
    model.forward = model._kept_forward.__get__(model)
    del model._kept_forward


def replaced_forward(self, *args, **kwargs):
    """A library's own forward put on the instance (cache-dit's FLUX patch functor), which never calls ours."""
    return type(self).forward(self, *args, **kwargs)


def module_state(model):
    """What a patch or a library leaves on a model, comparable between two models: per module its class, instance
    attribute names but ``forward``, processor class, hook counts, and what its instance ``forward`` is: None where
    nn.Module calls the class's forward (absent, or that forward bound to the module, which a library's undo leaves),
    else its class and function."""
    def forward_of(m):
        f = vars(m).get("forward")
        if f is None or (getattr(f, "__self__", None) is m and getattr(f, "__func__", None) is type(m).forward):
            return None
        return type(f).__name__, getattr(f, "__func__", None)
    return [(name, type(m), sorted(set(vars(m)) - {"forward"}), type(getattr(m, "processor", None)),
             len(m._forward_hooks), len(m._forward_pre_hooks), forward_of(m)) for name, m in model.named_modules()]


def test_a_forward_wrapped_after_patch_runs_once_eager_and_graphs_say_they_pause(simulated, fastpath_log):
    model, twin, runner = simulated()
    steps_ref, steps = wrap_like_a_cache(twin), wrap_like_a_cache(model)
    for seed in (1, 2, 3):
        inputs = flux_transformer_inputs(model, seed=seed)
        assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    assert steps.steps == steps_ref.steps == 3  # no forward ran through the wrapper's state but the calls
    assert runner.backend.recorded == 0 and runner.captures == 0
    stats = runner.stats()
    reason = graphs.REASON_REPLACED.format(who="test_graphs.wrap_like_a_cache.<locals>.cached_forward")
    assert stats["status"] == f"paused: {reason}" and stats["eager"] == {reason: 3}
    assert f"cuda graphs: paused: {reason}" in str(fp.report(model))
    warnings = [r.getMessage() for r in fastpath_log.records if r.levelname == "WARNING"]
    assert warnings == [f"diffusers_fastpath: CUDA graphs of transformer are paused: {reason}"]


def test_graphs_resume_once_the_wrapper_puts_the_forward_back(simulated):
    model, twin, runner = simulated()
    wrap_like_a_cache(model)
    inputs = flux_transformer_inputs(model, seed=1)
    eager(model, inputs)
    unwrap_like_a_cache(model)  # binds the kept forward again (a GraphForward binds to itself)
    assert vars(model)["forward"] is runner.model_ref().__dict__["forward"] and runner.status == "on"
    for seed in (1, 2):
        inputs = flux_transformer_inputs(model, seed=seed)
        assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    assert runner.captures == 1 and runner.replays == 1


def test_a_forward_replaced_after_patch_is_said_in_the_report(simulated):
    """A library that puts its own forward on the instance never calls ours: `report` must not say "on"."""
    model, twin, runner = simulated()
    model.forward = replaced_forward.__get__(model)
    inputs = flux_transformer_inputs(model, seed=1)
    assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    status = runner.stats()["status"]
    assert status.startswith("paused: model.forward was replaced per instance after patch, by "
                             "test_graphs.replaced_forward")
    assert runner.captures == 0


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_whose_forward_is_replaced_says_paused_too(how, simulated, unpatch_after):
    """A copy's runner is rebuilt after its `GraphForward`, which told it the copied model: that must stay known."""
    import pickle

    model, twin, runner = simulated()
    other = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    unpatch_after(other)
    other.forward = replaced_forward.__get__(other)
    inputs = flux_transformer_inputs(other, seed=1)
    assert torch.equal(eager(other, inputs).sample, eager(twin, inputs).sample)
    assert other.__dict__[graphs.GRAPHS_ATTR].status.startswith("paused: model.forward was replaced per instance")
    del other.__dict__["forward"]


def test_a_forward_replaced_before_patch_keeps_graphs_off_naming_it(unpatch_after):
    model = build_flux_transformer("flux-tiny", torch.float32, seed=4)
    twin = build_flux_transformer("flux-tiny", torch.float32, seed=4)
    steps_ref, steps = wrap_like_a_cache(twin), wrap_like_a_cache(model)
    fp.patch(model)
    unpatch_after(model)
    runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", SimulatedGraphs())
    assert runner.status == ("off: model.forward is already replaced per instance, by test_graphs.wrap_like_a_cache."
                             "<locals>.cached_forward: recording would run it again and a replay would skip it")
    for seed in (1, 2):
        inputs = flux_transformer_inputs(model, seed=seed)
        assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    assert steps.steps == steps_ref.steps == 2 and runner.backend.recorded == 0


@pytest.mark.parametrize("order", ["unpatch_then_unwrap", "unwrap_then_unpatch"])
def test_patch_wrap_unwrap_unpatch_in_every_order_leaves_what_the_wrapper_alone_leaves(order):
    model = build_flux_transformer("flux-tiny", torch.float32, seed=4)
    alone = build_flux_transformer("flux-tiny", torch.float32, seed=4)
    wrap_like_a_cache(alone)
    unwrap_like_a_cache(alone)  # leaves the class's forward bound in the instance dict
    fp.patch(model)
    graphs.install(model, model.__dict__[STATE_ATTR], "transformer", SimulatedGraphs())
    inputs = flux_transformer_inputs(model, seed=1)
    eager(model, inputs)  # a capture, before the wrapper comes
    wrap_like_a_cache(model)
    eager(model, inputs)
    for step in (order.split("_then_")):
        fp.unpatch(model) if step == "unpatch" else unwrap_like_a_cache(model)
    assert module_state(model) == module_state(alone)
    assert torch.equal(eager(model, inputs).sample, eager(alone, inputs).sample)


def test_graphs_over_the_class_forward_a_wrapper_left_bound_and_undo_puts_it_back():
    """What ``disable_cache`` leaves (the class's own forward, bound, in the instance dict) wraps nothing: graphs go
    on, and unpatch leaves the model as it found it."""
    model = build_flux_transformer("flux-tiny", torch.float32, seed=4)
    twin = build_flux_transformer("flux-tiny", torch.float32, seed=4)
    wrap_like_a_cache(model)
    unwrap_like_a_cache(model)
    before, left = module_state(model), vars(model)["forward"]
    assert left.__func__ is type(model).forward and left.__self__ is model
    fp.patch(model)
    runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", SimulatedGraphs())
    assert runner.status == "on"
    for seed in (1, 2):
        inputs = flux_transformer_inputs(model, seed=seed)
        assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    assert runner.replays == 1
    fp.unpatch(model)
    assert module_state(model) == before and vars(model)["forward"] == left  # the same function bound to the model


def test_a_forward_replaced_on_a_class_after_capture_changes_the_fingerprint(monkeypatch):
    """A library that replaces ``nn.LayerNorm.forward`` (or a processor's ``__call__``) after a capture: the replay
    would run what the old one launched, so the fingerprint no longer matches (the call is captured again, or runs
    eager); put back, it matches."""
    from diffusers_fastpath.graphs import ModelFingerprint

    model = build_flux_transformer()
    fingerprint = ModelFingerprint(model, device_type="cpu")
    assert fingerprint.matches()
    original = torch.nn.LayerNorm.forward
    monkeypatch.setattr(torch.nn.LayerNorm, "forward", lambda self, x: original(self, x) * 1.5)
    assert not fingerprint.matches()
    monkeypatch.undo()
    assert fingerprint.matches()
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    monkeypatch.setattr(FluxAttnProcessor, "__call__", lambda self, *args, **kwargs: None)  # an attention's processor
    assert not fingerprint.matches()
    monkeypatch.undo()
    assert fingerprint.matches()


def test_the_signature_reads_fp32_precision_set_per_op_without_raising(set_precision):
    """torch >= 2.9 sets TF32 per backend and op (``torch.backends.cudnn.conv.fp32_precision = "ieee"``), and its
    legacy getters (``torch.get_float32_matmul_precision()``, ``cudnn.allow_tf32``) raise where the per-op settings
    differ: the graphs' signature read them, so a user's forward with ``cuda_graphs=True`` raised. It reads the
    per-op settings, and any change of them is a change of the signature."""
    from diffusers_fastpath import graphs

    cudnn = torch.backends.cudnn
    if not hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        pytest.skip("torch < 2.9: no per-op precision settings")
    before = graphs._global_state()
    set_precision(cudnn.conv, "ieee")
    set_precision(cudnn.rnn, "tf32")
    set_precision(torch.backends.cuda.matmul, "tf32")
    with pytest.raises(RuntimeError):
        torch.get_float32_matmul_precision()  # (what the signature read before)
    after = graphs._global_state()
    assert after != before



class _DerivesFromItsInput(torch.nn.Linear):
    """``x_embedder`` (called straight from the FLUX forward with its ``hidden_states`` input, a static input buffer
    while a graph records) adding a value derived from that input through `_rope_cache.derived`, which keeps it on
    the input tensor. ``seen``, where a class sets it (not the instance: the fingerprint would see it change), says
    per call whether the input carried a store (or a seal) when the call began and carries a store when it ends."""

    seen: list | None = None

    def forward(self, x):
        began = _rope_cache._DERIVED_ATTR in x.__dict__ or _rope_cache._SEAL_ATTR in x.__dict__
        out = super().forward(x) + _rope_cache.derived(x, "test-mean", lambda: x.mean())
        if self.seen is not None:
            self.seen.append((began, _rope_cache._DERIVED_ATTR in x.__dict__))
        return out


def test_the_capture_finds_no_value_the_warm_up_derived_from_an_input(unpatch_after):
    """The warm-up and the capture run the forward on the same static input buffers: a value the warm-up derived from
    one of them and kept on it (`_rope_cache.derived`) must be forgotten before the capture, which then seals the
    buffers for itself; the value is a tensor made outside the graph, which every replay with other inputs would
    read stale had the capture taken it (the seal names one call since, not a frame id, which the capture may
    share with the warm-up). (`TracedGraphs` traces through fx's module-call wrappers, which `derived` does not take
    for the model's own loop, so it never reuses there: the probe checks what the capture is handed.)"""
    from diffusers_fastpath.testing import TracedGraphs

    model = build_flux_transformer("flux-tiny", torch.float32, seed=4)
    twin = build_flux_transformer("flux-tiny", torch.float32, seed=4)

    class Probed(_DerivesFromItsInput):
        seen = []

    model.x_embedder.__class__, twin.x_embedder.__class__ = Probed, _DerivesFromItsInput
    fp.patch(model)
    unpatch_after(model)
    runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", TracedGraphs())
    a, b = flux_transformer_inputs(model, seed=1), flux_transformer_inputs(model, seed=2)
    assert torch.equal(eager(model, a).sample, eager(twin, a).sample)  # eager, then the warm-up and the capture
    eager_call, warm_up, capture = Probed.seen
    assert eager_call == (False, True) and warm_up == (False, True)  # `derived` keeps its value on the input here
    assert not capture[0]  # the capture began on static inputs without the warm-up's store
    for inputs in (b, a, b):
        assert torch.equal(eager(model, inputs).sample, eager(twin, inputs).sample)
    assert runner.replays == 3 and len(Probed.seen) == 3  # replays run no Python
