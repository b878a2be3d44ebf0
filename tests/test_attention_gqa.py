"""attention_gqa: Krea 2's grouped-query attention on its key and value heads as they are (``enable_gqa=True``)
instead of after ``repeat_interleave`` copies: the rewriter's form and its refusals, the guard's reasons (each the
eager copies and call), the tiny Krea 2 patched == unpatched on a CPU (the site counts its refusals) and with the op
reached (its guard taken as on CUDA); on the GPU the op against eager at Krea 2's shapes, with and without its
padding mask, verified, and the tiny model with the site fast."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from diffusers.models import attention_dispatch
from diffusers.models.attention_dispatch import dispatch_attention_fn

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models._rewriter_attention import _repeat_heads_if
from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops.attention_gqa import ATTENTION_GQA, attention_gqa, attention_gqa_ref
from diffusers_fastpath.testing import zoo


def _stmt(source: str) -> ast.stmt:
    return ast.parse(textwrap.dedent(source)).body[0]


IF = """
if g > 1:
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
"""


def test_repeat_heads_if_form():
    assert _repeat_heads_if(_stmt(IF)) == ("g", "k", "v")
    for bad in (IF.replace("dim=2", "dim=1"), IF.replace("g > 1", "g >= 1"), IF.replace("g > 1", "g > 2"),
                IF + "else:\n    pass\n", IF.replace("v = v.", "v = k."), IF.replace("v = v.", "k = k."),
                IF.replace("repeat_interleave(g,", "repeat_interleave(2,"), IF + "    w = 1\n",
                IF.replace("dim=2)", "dim=2, output_size=None)")):
        assert _repeat_heads_if(_stmt(bad)) is None, bad


def _operands(batch, seq, heads, kv, dim, dtype, device, seed, masked):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, h, dim, generator=gen, device=device).to(dtype) for h in (heads, kv, kv))
    mask = None
    if masked:  # Krea 2's text padding mask: [B, 1, 1, S] bool, padding in the middle of the prompt
        mask = torch.ones(batch, 1, 1, seq, dtype=torch.bool, device=device)
        mask[..., 5: seq // 8] = False
    return q, k, v, mask


@pytest.mark.parametrize("case, reason", [
    ("cpu", "device cpu"), ("fp32", "dtype float32"), ("groups", "shape"), ("one-group", "shape"),
    ("dispatch", "attention is not diffusers' dispatch_attention_fn"), ("keyword", "arguments"),
    ("parallel", "arguments"), ("backend", "attention backend not native"), ("grad", "requires grad")])
def test_guard_refuses_with_reason_and_the_call_is_eager(case, reason):
    q, k, v, mask = _operands(1, 24, 4, 2, 16, torch.bfloat16, "cpu", 0, True)
    dispatch, groups, kwargs = dispatch_attention_fn, 2, {"attn_mask": mask, "backend": None, "parallel_config": None}
    if case == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "groups":
        groups = 3
    elif case == "one-group":
        groups = 1
    elif case == "dispatch":
        dispatch = lambda q, k, v, **kw: dispatch_attention_fn(q, k, v, **kw)  # noqa: E731
    elif case == "keyword":
        kwargs["scale"] = 0.5
    elif case == "parallel":
        kwargs["parallel_config"] = object()
    elif case == "backend":
        kwargs["backend"] = "flash"
    elif case == "grad":
        q.requires_grad_(True)
    arguments = tuple(sorted(kwargs.items()))
    assert ATTENTION_GQA.guard(dispatch, q, k, v, groups, arguments, check_pointers=False) == reason
    if case in ("cpu", "fp32", "dispatch", "keyword", "grad"):
        site = Site("attention_gqa")
        with torch.set_grad_enabled(case == "grad"):
            got = attention_gqa(dispatch, q, k, v, groups, site, **kwargs)
            ref = dispatch_attention_fn(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), **kwargs)
        assert torch.equal(got, ref) and site.fallback == {reason: 1} and not site.fast


def test_the_active_backend_decides_when_none_is_named():
    q, k, v, mask = _operands(1, 24, 4, 2, 16, torch.bfloat16, "cpu", 0, False)
    arguments = (("attn_mask", None), ("backend", None), ("parallel_config", None))
    assert ATTENTION_GQA.guard(dispatch_attention_fn, q, k, v, 2, arguments, check_pointers=False) == "device cpu"
    with attention_dispatch.attention_backend("_native_math"):
        assert (ATTENTION_GQA.guard(dispatch_attention_fn, q, k, v, 2, arguments, check_pointers=False)
                == "attention backend not native")


def _krea2_sites(device: str, calls: int):
    """The tiny Krea 2 on `device`, patched: `calls` forwards each equal to unpatched; its attention_gqa sites of the
    attentions with grouped heads (the text fusion's have as many key/value heads as query heads: their ``if`` is not
    taken, nothing counted, checked here), unpatched again before they are returned."""
    model = zoo.build("krea2", dtype=torch.bfloat16, device=device)
    kwargs = zoo.inputs("krea2", model)
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    fp.patch(model)
    try:
        with torch.no_grad():
            for _ in range(calls):
                assert torch.equal(model(**kwargs)[0], ref)
        grouped, others = [], []
        for m in model.modules():
            for _, s in sites_of(m):
                if s.op == "attention_gqa":
                    (grouped if m.num_heads != m.num_kv_heads else others).append(s)
        assert grouped and all(not s.fast and not s.fallback for s in others), others
        return grouped
    finally:
        fp.unpatch(model)


def test_tiny_krea2_patched_equals_unpatched_on_cpu():
    """On a CPU the op refuses ("device cpu", counted on its site per attention) and the copies run as written."""
    assert all(s.fallback == {"device cpu": 1} for s in _krea2_sites("cpu", 1))


def test_tiny_krea2_reaches_the_op_when_taken_for_cuda(monkeypatch):
    """The guard's device taken as a GPU's: every attention runs the grouped call (verified against the copies on
    its first call), the output equal to unpatched."""
    guard = ATTENTION_GQA.guard

    def on_cpu(*args, check_pointers=True):
        reason = guard(*args, check_pointers=False)
        return None if reason == "device cpu" else reason

    monkeypatch.setattr(ATTENTION_GQA, "guard", on_cpu)
    monkeypatch.setattr(ATTENTION_GQA, "verified", set())
    try:
        sites = _krea2_sites("cpu", 1)
        assert all(s.fast == 1 and not s.fallback for s in sites), sites
        assert ATTENTION_GQA.disabled is None and ATTENTION_GQA.verified
    finally:
        ATTENTION_GQA.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 4608, 48, 12, 128), (2, 4608, 48, 12, 128), (1, 1536, 24, 6, 128)], ids=str)
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "nomask"])
def test_matches_eager_bitwise_on_the_gpu(shape, dtype, masked):
    batch, seq, heads, kv, dim = shape
    for seed in range(2):
        q, k, v, mask = _operands(batch, seq, heads, kv, dim, dtype, "cuda", seed, masked)
        kwargs = {"attn_mask": mask, "backend": None, "parallel_config": None}
        site = Site("attention_gqa")
        with torch.no_grad():
            got = attention_gqa(dispatch_attention_fn, q, k, v, heads // kv, site, **kwargs)
            ref = attention_gqa_ref(dispatch_attention_fn, q, k, v, heads // kv, tuple(sorted(kwargs.items())))
        assert torch.equal(got, ref) and site.fast == 1, site.fallback
    assert ATTENTION_GQA.disabled is None


@pytest.mark.gpu
def test_tiny_krea2_on_the_gpu_has_its_attention_fast():
    sites = _krea2_sites("cuda", 2)
    assert all(s.fast == 2 and not s.fallback for s in sites), sites
