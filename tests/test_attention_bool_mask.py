"""The boolean attention mask made additive once per forward (`diffusers_fastpath.ops.attention_bool_mask`): the
processor's call with torch's own additive mask is the call as written, bit for bit; the mask is made once per
forward where the forward is closed, in every call elsewhere; the guard refuses what it must."""

from __future__ import annotations

import contextlib

import pytest
import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch.nn.attention import SDPBackend

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.ops import attention_bool_mask as abm
from diffusers_fastpath.testing import zoo

EFFICIENT, CUDNN = int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)


def _ideogram():
    model = zoo.build("ideogram4", dtype=torch.bfloat16, device="cpu")
    return model, zoo.inputs("ideogram4", model)


def _mask_sites(model):
    return [s for m in model.modules() for _, s in sites_of(m) if s.op == "attention_bool_mask"]


def _counting(monkeypatch):
    made = []
    real = abm.additive_mask

    def counted(mask, kind, dtype):
        made.append(kind)
        return real(mask, kind, dtype)

    monkeypatch.setattr(abm, "additive_mask", counted)
    return made


@contextlib.contextmanager
def _patched(model, kwargs):
    """The model's output as written; inside, the model patched, its verified forward run (without hooks: a hooked
    model runs as written until it is); unpatched after."""
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    fp.patch(model)
    try:
        with torch.no_grad():
            model(**kwargs)
            yield ref
    finally:
        fp.unpatch(model)


def test_made_once_per_forward_and_bit_identical(emulated_kernels, monkeypatch):
    model, kwargs = _ideogram()
    with _patched(model, kwargs) as ref:
        made = _counting(monkeypatch)
        assert torch.equal(model(**kwargs)[0], ref)
        sites = _mask_sites(model)
        assert len(sites) == len(model.layers) and all(s.fast == 2 and not s.fallback for s in sites), sites
    assert made == [EFFICIENT]  # one mask, two blocks: made by the first, kept on the mask for the second


def test_made_in_every_call_where_a_hook_could_hold_the_mask(emulated_kernels, monkeypatch):
    model, kwargs = _ideogram()
    with _patched(model, kwargs) as ref:
        handle = model.layers[0].register_forward_hook(lambda module, args, out: None)
        try:
            made = _counting(monkeypatch)
            assert torch.equal(model(**kwargs)[0], ref)
        finally:
            handle.remove()
    assert made == [EFFICIENT] * len(model.layers)  # not sealed: each block makes its own, as eager does


def test_another_kernel_for_the_additive_mask_runs_as_written(emulated_kernels, monkeypatch):
    model, kwargs = _ideogram()
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    monkeypatch.setattr(abm, "SDPA_CHOICE", lambda q, k, v, mask, kw: EFFICIENT if mask.dtype is torch.bool else CUDNN)
    monkeypatch.setattr(abm, "_OTHER_KERNEL", set())
    fp.patch(model)
    try:
        with torch.no_grad():
            model(**kwargs)
            out = model(**kwargs)[0]
        assert torch.equal(out, ref)
        reasons = {r for s in _mask_sites(model) for r in s.fallback}
        assert reasons == {"the additive mask picks another attention kernel"}, reasons
    finally:
        fp.unpatch(model)


def _operands(dtype=torch.bfloat16, device="cpu", b=1, s=24, h=2, d=32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device, dtype) for _ in range(3))
    seg = torch.zeros(b, s, dtype=torch.long, device=device)
    seg[:, s // 3:] = 1
    return q, k, v, (seg.unsqueeze(2) == seg.unsqueeze(1)).unsqueeze(1)


@pytest.mark.parametrize("case, reason", [
    (dict(mask="2d"), "not a 4-D boolean mask"),
    (dict(mask="float"), "not a 4-D boolean mask"),
    (dict(dtype=torch.float32), "dtype float32"),
    (dict(kw={"parallel_config": object()}), "arguments"),
    (dict(kw={"dropout_p": 0.1}), "arguments"),
    (dict(kw={"window": 3}), "arguments"),
    (dict(kw={"backend": "flash"}), "attention backend not native"),
    (dict(dispatch="other"), "attention is not diffusers' dispatch_attention_fn"),
])
def test_guard_refuses(case, reason, monkeypatch):
    monkeypatch.setattr(abm, "SDPA_CHOICE", lambda *args: EFFICIENT)
    q, k, v, mask = _operands(case.get("dtype", torch.bfloat16))
    if case.get("mask") == "2d":
        mask = mask[:, 0, 0]
    elif case.get("mask") == "float":
        mask = mask.to(q.dtype)
    kw = {"attn_mask": mask, **case.get("kw", {})}
    dispatch = (lambda *a, **k: None) if case.get("dispatch") else dispatch_attention_fn
    assert abm._guard(dispatch, q, k, v, None, tuple(sorted(kw.items()))) == reason


def test_guard_refuses_kernels_it_does_not_know(monkeypatch):
    q, k, v, mask = _operands()
    monkeypatch.setattr(abm, "SDPA_CHOICE", lambda *args: int(SDPBackend.MATH))
    guard = abm._guard
    assert guard(dispatch_attention_fn, q, k, v, None, (("attn_mask", mask),)) == "attention kernel math"
    monkeypatch.setattr(abm, "SDPA_CHOICE", lambda *args: EFFICIENT)
    assert guard(dispatch_attention_fn, q, k, v, None, (("attn_mask", mask),)) == "device cpu"

    def failing(*args):
        raise RuntimeError("no choice")

    monkeypatch.setattr(abm, "SDPA_CHOICE", failing)
    assert guard(dispatch_attention_fn, q, k, v, None, (("attn_mask", mask),)) == "torch's attention kernel choice failed"


def test_no_mask_or_another_mask_runs_as_written_uncounted(emulated_kernels):
    from diffusers_fastpath.models._chain_calls import _ChainsNamespace as NS
    from diffusers_fastpath.ops._policy import Site

    q, k, v, mask = _operands()
    site = Site("attention_bool_mask")
    for m in (None, mask[:, 0, 0], mask.to(q.dtype), mask[:, :, :1]):  # (the last a key-padding one, [B, 1, 1, S])
        assert torch.equal(NS.attention_bool_mask(dispatch_attention_fn, q, k, v, site, attn_mask=m),
                           dispatch_attention_fn(q, k, v, attn_mask=m))
    assert site.fast == 0 and not site.fallback


def test_a_key_padding_mask_made_per_call_runs_as_written(emulated_kernels, monkeypatch):
    """Bria FIBO 2's cross-attentions (the Perceiver's, the injection blocks') get the forward's [B, L] text mask and
    make it [B, 1, 1, L] in every call (a new view each time): run as written, uncounted, nothing made or kept; the
    forward seals one tensor, the noise mask of the blocks' per-token rows, so walks the model once, not once more per
    cross-attention (`derived`'s seal of each new view: 7 walks of 990 modules a step at full size)."""
    from diffusers_fastpath.models import _rope_cache

    model = zoo.build("bria-fibo2", dtype=torch.bfloat16)
    kwargs = zoo.inputs("bria-fibo2", model, batch=2)
    assert not kwargs["encoder_attention_mask"].all()  # (padded text: a mask the processors pass on)
    with _patched(model, kwargs) as ref:
        made, walks, closed = _counting(monkeypatch), [], _rope_cache._closed
        monkeypatch.setattr(_rope_cache, "_closed", lambda m: walks.append(m) or closed(m))
        assert torch.equal(model(**kwargs)[0], ref)
        sites = _mask_sites(model)
        assert sites and all(s.fast == 0 and not s.fallback for s in sites), sites
    assert made == [] and walks == [model]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 4608, 18, 256), (2, 1100, 5, 128), (1, 333, 4, 64)])
def test_additive_mask_is_the_call_as_written_on_cuda(shape, dtype):
    b, s, h, d = shape
    q, k, v, mask = _operands(dtype, "cuda", b, s, h, d)
    mask[..., 7, :] = False  # a row with no key: -65504 and -inf give different results, so the form matters
    kwargs = {"attn_mask": mask}
    kind = abm.sdpa_choice(q, k, v, mask, kwargs)
    ref = dispatch_attention_fn(q, k, v, attn_mask=mask)
    if kind not in abm._TAKEN:
        pytest.skip(f"torch picks {SDPBackend(kind).name} here")
    additive = abm.additive_mask(mask, kind, dtype)
    assert abm.sdpa_choice(q, k, v, additive, kwargs) == kind
    out = torch.full_like(ref, float("nan"))
    out.copy_(dispatch_attention_fn(q, k, v, attn_mask=additive))
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def test_additive_mask_is_aten_expression_with_the_zero_on_the_mask_device():
    """Both kinds: the values of aten's expression (cuDNN's zero made on the host there), from operands on the
    mask's device only (a host operand is a host-to-device copy, which a CUDA graph capture refuses)."""
    _, _, _, mask = _operands()
    mask[..., 5, :] = False
    for kind, fill in ((CUDNN, -65504.0), (EFFICIENT, -float("inf"))):
        for dtype in (torch.bfloat16, torch.float16):
            made = []
            real = torch.scalar_tensor

            def spy(*args, **kwargs):
                made.append(torch.device(kwargs.get("device") or "cpu"))
                return real(*args, **kwargs)

            torch.scalar_tensor = spy
            try:
                additive = abm.additive_mask(mask.to("meta"), kind, dtype)
            finally:
                torch.scalar_tensor = real
            assert made == [torch.device("meta")] and additive.device.type == "meta"
            got = abm.additive_mask(mask, kind, dtype)
            want = torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype))
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [CUDNN, EFFICIENT], ids=["cudnn", "efficient"])
def test_additive_mask_captures_in_a_cuda_graph(kind):
    """Made inside a CUDA graph capture (as in Ideogram 4's captured forward), the additive mask replays the values
    of aten's own expression."""
    _, _, _, mask = _operands(device="cuda", s=40)
    mask[..., 3, :] = False
    fill = -65504.0 if kind == CUDNN else -float("inf")
    want = torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=torch.bfloat16)).cuda()
    static = mask.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        abm.additive_mask(static, kind, torch.bfloat16)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = abm.additive_mask(static, kind, torch.bfloat16)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_sdpa_capturable_is_torch_sdpa_off_cuda_and_qwen21_records_with_it():
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel

    from diffusers_fastpath import graphs

    q, k, v, mask = (t.transpose(1, 2) if t.dim() == 4 and t.dtype is not torch.bool else t for t in _operands())
    for m in (mask, None, torch.zeros(mask.shape, dtype=q.dtype)):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        assert torch.equal(abm.sdpa_capturable(q, k, v, attn_mask=m), want)
    assert any(module is torch.nn.functional and twin is abm.sdpa_capturable
               for module, _, _, twin in graphs.CAPTURE_TWINS[QwenImage21Transformer2DModel])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 300, 4, 128), (2, 77, 2, 64)])
@pytest.mark.parametrize("form", ["causal", "key_padding"])
def test_sdpa_capturable_captures_and_equals_torch(shape, dtype, form):
    """A boolean mask on torch's SDPA inside a CUDA graph capture (Qwen-Image 2.1's segment masks): the twin's replay
    equals torch's call with the boolean mask, bit for bit; where torch picks cuDNN for it, torch's own call cannot
    be captured (its zero is copied from the host)."""
    b, s, h, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to("cuda", dtype) for _ in range(3))
    if form == "causal":
        mask = torch.tril(torch.ones(s, s, dtype=torch.bool, device="cuda"))[None, None]
    else:
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
        mask[0, ..., s // 2:] = False
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    kind = int(torch._fused_sdp_choice(q, k, v, mask, 0.0, False))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        abm.sdpa_capturable(q, k, v, attn_mask=mask)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = abm.sdpa_capturable(q, k, v, attn_mask=mask)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref), SDPBackend(kind).name
