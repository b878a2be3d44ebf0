"""What a patched forward asks on every call, asked more cheaply (tools/host_overhead.py measures it): each cheaper
form gives the answer of the form it replaced, on every input tried here."""

from __future__ import annotations

import itertools

import pytest
import torch
from diffusers.models.normalization import FP32LayerNorm
from torch import nn
from torch.utils import _pytree as pytree

from diffusers_fastpath import graphs, verify
from diffusers_fastpath.ops import _policy
from diffusers_fastpath.ops.modulate_scale_shift import rows_guard


# --- the verification's key of a call (`verify.call_key`) ---------------------------------------------------------


def _flattened_key(args: tuple, kwargs: dict) -> tuple:
    """The key as every call computed it before the flat form: pytree's structure, each leaf's key."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (str(spec), tuple(map(verify._leaf_key, leaves)), torch.is_grad_enabled(), graphs._global_state())


def _flat_calls() -> list[tuple[tuple, dict]]:
    x = torch.randn(2, 8, 16)
    values = [x, x[:1], x.transpose(1, 2), x.bfloat16(), x.clone().requires_grad_(), torch.randn(2, 8, 16), None,
              True, 1, 1.0, "1", False, 0]
    calls = [((), {"hidden_states": v, "timestep": w}) for v, w in itertools.product(values, values[:7])]
    calls += [((v,), {"timestep": w}) for v, w in itertools.product(values[:7], values[:3])]
    calls += [((), {"timestep": x, "hidden_states": x}), ((x, x), {}), ((x,), {}), ((), {"hidden_states": x}),
              ((), {}), ((), {"hidden_states": x, "return_dict": False}), ((x, False), {})]
    return calls


def test_call_key_of_a_flat_call_tells_calls_apart_as_the_flattened_key_does():
    """A call of tensors and plain values is keyed without pytree; two such calls share a key exactly where the
    flattened key (structure, each tensor's shape, strides, dtype, device, requires_grad, each value) was shared."""
    calls = _flat_calls()
    new = [verify.call_key(*c) for c in calls]
    old = [_flattened_key(*c) for c in calls]
    for i, j in itertools.product(range(len(calls)), repeat=2):
        assert (new[i] == new[j]) == (old[i] == old[j]), (calls[i], calls[j])
        assert (hash(new[i]) == hash(new[j])) or new[i] != new[j]


def test_call_key_of_a_nested_call_is_the_flattened_key_and_never_a_flat_ones():
    x = torch.randn(2, 8, 16)
    nested = [((), {"hidden_states": x, "attention_kwargs": {"scale": 1.0}}), ((), {"img_shapes": [(1, 4, 4)]}),
              ((nn.Parameter(x),), {}), (((x, x),), {})]  # a dict, a list, a tensor subclass, a tuple
    for args, kwargs in nested:
        assert verify.call_key(args, kwargs) == _flattened_key(args, kwargs)
    flat = {verify.call_key(*c) for c in _flat_calls()}
    assert not flat & {verify.call_key(*c) for c in nested}
    assert verify.call_key((nn.Parameter(x),), {}) != verify.call_key((x,), {})  # (a subclass: its own key)


def test_call_key_changes_with_grad_mode_and_the_settings_that_pick_kernels():
    x = torch.randn(2, 8, 16)
    key = verify.call_key((), {"hidden_states": x})
    with torch.no_grad():
        assert verify.call_key((), {"hidden_states": x}) != key
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = not old
    try:
        assert verify.call_key((), {"hidden_states": x}) != key
    finally:
        torch.backends.cudnn.benchmark = old
    assert verify.call_key((), {"hidden_states": x}) == key


# --- the settings read on every verified forward and every CUDA graph call (`_policy.setting_reader`) ------------


def _settings() -> list[tuple[object, str]]:
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    return [(torch.backends, "fp32_precision"), (cuda.matmul, "fp32_precision"), (cudnn, "fp32_precision"),
            (getattr(cudnn, "conv", None), "fp32_precision"), (getattr(cudnn, "rnn", None), "fp32_precision"),
            (cudnn, "allow_tf32"), (cudnn, "enabled"), (cudnn, "benchmark"), (cudnn, "deterministic"),
            (cuda.matmul, "allow_fp16_accumulation"), (None, "fp32_precision")]


def test_setting_reader_reads_what_the_attribute_reads_now(set_precision):
    readers = [(_policy.setting_reader(obj, name), obj, name) for obj, name in _settings()]

    def outcome(read):
        try:
            return read()
        except RuntimeError as exc:  # (cudnn.allow_tf32 where conv and rnn differ: both ways raise)
            return str(exc)

    def check():
        for read, obj, name in readers:
            assert outcome(read) == outcome(lambda: getattr(obj, name, None)), (obj, name)

    check()
    cudnn = torch.backends.cudnn
    old = cudnn.benchmark, cudnn.deterministic, cudnn.enabled
    try:
        cudnn.benchmark, cudnn.deterministic, cudnn.enabled = not old[0], not old[1], not old[2]
        check()
    finally:
        cudnn.benchmark, cudnn.deterministic, cudnn.enabled = old
    if hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        set_precision(cudnn.conv, "ieee" if cudnn.conv.fp32_precision != "ieee" else "tf32")
        set_precision(torch.backends.cuda.matmul, "tf32")
        check()
    check()


def test_setting_reader_takes_the_c_getter_of_torchs_settings_objects():
    """The C getters behind ``ContextProp`` and ``_FP32Precision`` (where this torch has them): no Python frame per
    read. Anything else is read as it is."""
    cudnn = torch.backends.cudnn
    prop = getattr(torch.backends, "ContextProp", None)
    if prop is None or not isinstance(type(cudnn).__dict__.get("benchmark"), prop):
        pytest.skip("this torch keeps cudnn.benchmark otherwise")
    assert _policy.setting_reader(cudnn, "benchmark") is type(cudnn).__dict__["benchmark"].getter
    if type(getattr(cudnn, "conv", None)).__name__ == "_FP32Precision":
        reader = _policy.setting_reader(cudnn.conv, "fp32_precision")
        assert reader.func is torch._C._get_fp32_precision_getter and reader.args == ("cuda", "conv")


def test_global_state_is_the_settings_as_read_through_torch_backends():
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    state = graphs._global_state()
    assert state[-3:] == (cudnn.enabled, cudnn.benchmark, cudnn.deterministic)
    assert state[3:7] == (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
                          cuda.cudnn_sdp_enabled())
    per_op = tuple(getattr(o, "fp32_precision", None) for o, _ in _settings()[:5])
    assert _policy.fp32_precision_state()[:5] == per_op


# --- the guards and the rewritten chains' own questions ----------------------------------------------------------


def _rows_guard_as_written(x, scale, shift, rows_dtype):
    """`rows_guard` as it read before each size and stride was read once (the layout checks; the device ones after
    it are the same lines)."""
    if x.dtype not in _policy.HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if scale.dtype is not rows_dtype or shift.dtype is not rows_dtype:
        return "mixed dtypes"
    if x.dim() != 3 or scale.dim() != 2 or shift.dim() != 2:
        return "shape"
    batch, _, dim = x.shape
    vec = 16 // x.element_size()
    if dim % vec:
        return f"D not a multiple of {vec}"
    if scale.shape[1] != dim or shift.shape[1] != dim or scale.shape[0] not in (1, batch) or shift.shape[0] not in (1, batch):
        return "shape"
    if x.numel() == 0:
        return "empty"
    if not x.is_contiguous():
        return "x not contiguous"
    rows_vec = 16 // scale.element_size()

    def rows_ok(t):
        rows = t.shape[0]
        return t.stride(1) == 1 and (rows == 1 or t.stride(0) % rows_vec == 0)

    if not (rows_ok(scale) and rows_ok(shift)):
        return "scale/shift strided"
    return "device cpu"  # (the CPU tensors here: what the guard's device check says)


def test_rows_guard_gives_the_reason_it_gave_before_on_every_layout():
    base = torch.randn(4, 6, 3 * 64)
    xs = [torch.randn(b, 5, d).bfloat16() for b in (1, 2) for d in (64, 60)]
    xs += [torch.randn(2, 5, 128).bfloat16()[..., ::2], torch.randn(2, 0, 64).bfloat16(), torch.randn(5, 64).bfloat16(),
           torch.randn(2, 5, 64)]
    rows = []
    for b in (1, 2, 3):
        for dtype in (torch.bfloat16, torch.float32):
            t = base[:b].to(dtype)
            rows += [t[:, 0, :64], t[:, 1, 4:68], t[:, 0, ::3], t[:, :, 0], t[:, 0, :60], t.reshape(b, -1)[:, :64],
                     t[:, 0, :64].t().contiguous().t(), t[:, 0, :64].contiguous(), t[:, 0, :64].unsqueeze(0)]
    checked = 0
    for x in xs:
        for scale, shift in itertools.product(rows, repeat=2):
            if scale.dim() == 2 and shift.dim() == 2 and (scale.shape[0] > 3 or shift.shape[0] > 3):
                continue
            for rows_dtype in (x.dtype, torch.float32):
                assert rows_guard(x, scale, shift, rows_dtype, False) == _rows_guard_as_written(x, scale, shift, rows_dtype)
                checked += 1
    assert checked > 5000


def test_other_layernorm_reads_the_norms_weight_and_bias_as_attributes_do():
    from diffusers_fastpath.models._chain_calls import _other_layernorm

    plain, affine = nn.LayerNorm(64, elementwise_affine=False), nn.LayerNorm(64)
    bias_only = nn.LayerNorm(64, bias=True)
    bias_only.weight = None  # (registered as None)
    shadowed = nn.LayerNorm(64, elementwise_affine=False)
    object.__setattr__(shadowed, "weight", torch.ones(64))  # an instance attribute over the registered None
    for norm in (plain, affine, bias_only, shadowed, FP32LayerNorm(64), nn.RMSNorm(64)):
        expected = (type(norm) is FP32LayerNorm
                    or type(norm) is nn.LayerNorm and (norm.weight is not None or norm.bias is not None))
        assert _other_layernorm(norm) == expected, norm


def test_norm_modulate_rows_hands_the_op_the_rows_it_handed_before(monkeypatch):
    """``[B, 1, D]`` rows go to the LayerNorm + modulate as ``[B, D]`` views with ``[:, 0]``'s sizes, strides and
    storage offset (``squeeze(1)`` makes the same view, cheaper)."""
    from diffusers_fastpath.models import _chain_calls

    seen = []
    monkeypatch.setattr(_chain_calls, "norm_modulate", lambda norm, x, scale, shift, site: seen.append((scale, shift)))
    emb = torch.randn(2, 6, 64).bfloat16()
    x = torch.randn(2, 5, 64).bfloat16()
    for scale, shift in ((emb[:, 1:2], emb[:, 0:1]), (emb[:1, 3:4], emb[:, 2:3])):
        _chain_calls._ChainsNamespace.norm_modulate_rows(nn.LayerNorm(64, elementwise_affine=False), x, scale, shift,
                                                         None)
        for got, rows in zip(seen.pop(), (scale, shift)):
            want = rows[:, 0]
            assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
            assert got.untyped_storage().data_ptr() == want.untyped_storage().data_ptr()


# --- who calls the blocks (`models._driver`), asked per hand-off and per derived rotary value -----------------------


def test_is_module_call_knows_torchs_frames_and_the_bound_safe_wrappers_by_identity():
    """Module-call frames are told by their code object's identity (hashing a code object costs a microsecond): the
    frames of a module call, with hooks or without, and of a `bound_safe` wrapper are; the caller's frame and a frame
    running an equal copy of torch's code are not (what relies on this then refuses: the blocks compute as written)."""
    import sys
    import types

    from diffusers_fastpath._state import bound_safe
    from diffusers_fastpath.models._driver import is_module_call, module_caller

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            frame = sys._getframe()
            seen.append((frame.f_back, module_caller(frame)))
            return x

    class Wrapped(Probe):
        def forward(self, x):
            return super().forward(x)

    bound_safe(Wrapped)
    here = sys._getframe()
    probe = Probe()
    probe(1)
    probe.register_forward_hook(lambda m, a, o: None)
    probe(1)
    Wrapped()(1)
    assert [is_module_call(back) for back, _ in seen] == [True, True, True]
    assert all(caller is here for _, caller in seen[:2]) and seen[2][1] is not None
    assert not is_module_call(here) and not is_module_call(None)
    impl = nn.Module._call_impl.__code__
    copy = impl.replace()  # equal (the same code), another object
    assert copy == impl and copy is not impl
    frame = types.SimpleNamespace(f_code=copy)
    assert not is_module_call(frame) and is_module_call(types.SimpleNamespace(f_code=impl))


def _closed_as_before(model: nn.Module) -> bool:
    """`_rope_cache._closed` as it asked before its own walk: ``model.modules()``, `hooks_on` of each."""
    from diffusers_fastpath.models._rope_cache import _known

    for module in model.modules():
        if module is not model and _policy.hooks_on(module):
            return False
        processor = module.__dict__.get("processor")
        if processor is not None and not (_known(processor) and _known(module)):
            return False
    return all(_known(block) for blocks in model.children() if isinstance(blocks, nn.ModuleList) for block in blocks)


def test_closed_answers_as_the_walk_over_model_modules_did():
    """`_closed` (asked at each table's first use in a forward: a walk of the whole model) walks the modules itself and
    asks the global hooks once; on a tiny Bria FIBO 2 with a hook, a replaced forward or a foreign processor put on each
    of its modules in turn (one shared by two parents too), a foreign block, global hooks, it answers as before."""
    from diffusers_fastpath.models._rope_cache import _closed
    from diffusers_fastpath.testing import zoo

    model = zoo.build("bria-fibo2", dtype=torch.float32)
    shared = model.layers[0].feed_forward
    model.layers[1].shared = shared  # (one module under two parents: walked once, hooked either way)
    assert _closed(model) and _closed_as_before(model)
    cases = 0
    for module in model.modules():
        for kind in ("hook", "pre-hook", "forward", "processor"):
            if kind == "hook":
                undo = module.register_forward_hook(lambda m, a, o: None).remove
            elif kind == "pre-hook":
                undo = module.register_forward_pre_hook(lambda m, a: None).remove
            elif kind == "forward":
                module.forward = module.forward
                undo = lambda m=module: delattr(m, "forward")  # noqa: E731
            else:
                saved = module.__dict__.get("processor")
                module.__dict__["processor"] = object()  # (not diffusers' nor this package's)
                undo = (lambda m=module, p=saved: m.__dict__.__setitem__("processor", p) if p is not None
                        else m.__dict__.pop("processor"))
            try:
                assert _closed(model) == _closed_as_before(model) == (module is model and kind != "processor")
            finally:
                undo()
            cases += 1
    assert cases == 4 * len(list(model.modules())) and _closed(model)
    undo = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None).remove
    try:
        assert not _closed(model) and not _closed_as_before(model)
    finally:
        undo()
    model.layers.append(nn.Identity())  # a block of torch's
    assert not _closed(model) and not _closed_as_before(model)


def test_host_overhead_tool_runs(tmp_path):
    """tools/host_overhead.py, in a process of its own (it swaps every op's guard and kernel): the forward split and
    the per-op rows, at the smallest counts."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "host_overhead.py"), "--forwards", "1",
                          "--rounds", "1", "--calls", "3"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": root}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in ("sana (tiny, bf16, CPU, 1 thread), one forward, us", "patched, no verification hooks",
                 "the fused ops' policy", "policy inside the forward", "layernorm_scale_shift", "launch:"):
        assert line in out.stdout, out.stdout
