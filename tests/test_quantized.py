"""Quantized and memory-saving models (issue 19): the tiny FLUX in bf16, quantized through diffusers' own backends
(`diffusers_fastpath.bench.quant`), patched after (and, where the backend can quantize a live model, before)
quantizing: ``torch.equal`` to the same quantized model unpatched, the sites counted, the high tier refusing the
GEMM fusion a quantized linear cannot take and saying why, CUDA graphs replaying or saying why. A backend that is
not installed skips; bitsandbytes needs CUDA through diffusers and runs in the GPU tests at the end."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath import bench, graphs
from diffusers_fastpath.bench import quant
from diffusers_fastpath.models import _handoff
from diffusers_fastpath._state import STATE_ATTR
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

CPU = torch.device("cpu")
GPU_BACKENDS = list(quant.QUANTS)
CPU_BACKENDS = [name for name, q in quant.QUANTS.items() if q.cuda_only is None]
IN_PLACE = [name for name in CPU_BACKENDS if quant.QUANTS[name].in_place is not None]
# the FFN up-projections the high tier would fuse with their GELU: ff.net.0 and ff_context.net.0 of each dual block,
# proj_mlp of each single block (tiny FLUX: 2 + 2)
LINEAR_GELU_SITES = 2 * 2 + 2


def needs(name: str, device: torch.device = CPU) -> None:
    """Skip when the backend cannot run here (its package is missing: CI installs the test extras)."""
    reason = quant.unavailable(name, device)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: OpenMP's handoff costs more than the math on a shared 2-core VM
    yield
    torch.set_num_threads(old)


def forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.fixture(scope="module")
def bf16_model():
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cpu", seed=19)
    return model, flux_transformer_inputs(model, seed=20)


@pytest.fixture
def quantized(bf16_model, unpatch_after):
    """``make(name) -> (quantized model, inputs, its unpatched output)``, each call a fresh build from the same
    weights."""

    def make(name: str):
        needs(name)
        base, inputs = bf16_model
        model = quant.quantize(copy.deepcopy(base), name, CPU)  # layerwise casting changes the model it is given
        unpatch_after(model)
        return model, inputs, forward(model, inputs)

    return make


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_quantized_weights_are_the_random_weights_quantized(name, bf16_model, quantized):
    base, inputs = bf16_model
    model, _, ref = quantized(name)
    linears = dict(model.named_modules())
    ffn = "transformer_blocks.0.ff.net.0.proj"
    assert quant.is_quantized(linears[ffn]) and not quant.is_quantized(dict(base.named_modules())[ffn])
    n = sum(map(quant.is_quantized, model.modules()))
    assert n >= LINEAR_GELU_SITES + 4 * 2, n  # at least the FFNs and the attention projections
    for layer, module in model.named_modules():
        if quant.is_quantized(module):
            w, w0 = quant.dequantized_weight(module), dict(base.named_modules())[layer].weight.float()
            assert w.shape == w0.shape and w.count_nonzero() > 0.9 * w.numel(), layer
            # the weights it was given, to 8-bit precision (fp8 e4m3 keeps 3 mantissa bits: 2^-4 relative)
            assert (w - w0).abs().max() <= 0.07 * w0.abs().max() and not torch.equal(w, w0), layer
    assert quant.weights_gib(model) < 0.8 * quant.weights_gib(base)
    assert not torch.equal(ref, forward(base, inputs))  # the quantized GEMMs changed the numbers


# What refuses hand-offs between blocks (`models._handoff`) besides the device: diffusers' layerwise casting hooks
# the linears of the text FFN that runs between the image stream's hand-off and the next block; optimum-quanto's
# linears, swapped in after patching, are in training mode.
HAND_OFF_REFUSED = {"layerwise-fp8": _handoff.REASON_HOOKS, "quanto-int8": _handoff.REASON_TRAINING}


def _counted(rep, values: str | None = None, hand_off: str | None = None) -> None:
    """Every site of the tiny FLUX is in the report and counted its calls; on CPU the fused ops fall back with
    reason "device cpu" (the token concatenation's view runs on any device). Quantized value projections get no joint
    value site; where they were quantized after patching (`values`: the reason) the two sites fall back for it.
    `hand_off`: a reason some hand-offs are refused for besides the device."""
    assert len(rep.sites) == 2 * 8 + 2 * 4 - 1 + 4 * 2 + 7 + (2 if values else 0), str(rep)  # 7: `_handoff`'s
    assert rep.fallback > 0 and all(s.fast + s.fallback > 0 for s in rep.sites), str(rep)
    assert {r for s in rep.sites if s.op != "linear_cat" for r in s.reasons} <= {"device cpu", hand_off}, str(rep)
    assert {r for s in rep.sites if s.op != "linear_cat" for r in s.reasons} >= {"device cpu"}, str(rep)
    assert all(set(s.reasons) == {values} for s in rep.sites if s.op == "linear_cat"), str(rep)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_patch_after_quantizing_is_bit_identical(name, quantized):
    model, inputs, ref = quantized(name)
    classes = [type(m) for m in model.modules()]
    fp.patch(model)
    assert torch.equal(forward(model, inputs), ref)
    _counted(fp.report(model), hand_off=HAND_OFF_REFUSED.get(name))
    fp.unpatch(model)
    assert [type(m) for m in model.modules()] == classes and torch.equal(forward(model, inputs), ref)


@pytest.mark.parametrize("name", IN_PLACE)
def test_patch_before_quantizing_is_bit_identical(name, bf16_model, unpatch_after):
    needs(name)
    base, inputs = bf16_model
    q = quant.QUANTS[name]
    reference = copy.deepcopy(base)
    q.in_place(reference)
    ref = forward(reference, inputs)
    model = copy.deepcopy(base)
    fp.patch(model)
    unpatch_after(model)
    q.in_place(model)
    assert sum(map(quant.is_quantized, model.modules())) == sum(map(quant.is_quantized, reference.modules())) > 0
    assert torch.equal(forward(model, inputs), ref)
    values = fp.report(model).sites
    reason = next(iter(next(s for s in values if s.op == "linear_cat").reasons))
    assert "quantized" in reason or "hooks" in reason, reason  # layerwise casting: hooks on the projections
    _counted(fp.report(model), reason, HAND_OFF_REFUSED.get(name))


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_high_tier_refuses_quantized_linears_and_says_why(name, quantized, fastpath_log):
    model, inputs, ref = quantized(name)
    fp.patch(model)
    with fp.quality(model, "high"):
        out = forward(model, inputs)
        rep = fp.report(model)
    gelu = [s for s in rep.tier_sites if s.op == "linear_gelu"]
    assert len(gelu) == LINEAR_GELU_SITES and not any(s.mounted for s in gelu)
    assert all("quantized" in s.cannot for s in gelu), [s.cannot for s in gelu]
    assert any("cannot" in r.getMessage() and "quantized" in r.getMessage() for r in fastpath_log.records)
    assert {s.op for s in rep.tier_sites} == {"linear_gelu"}  # the high tier's only fusion touches the linears
    assert torch.equal(out, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA behaviour")
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_cuda_graphs_without_cuda_have_no_effect_and_say_why(name, quantized):
    model, inputs, ref = quantized(name)
    fp.patch(model, cuda_graphs=True)
    assert torch.equal(forward(model, inputs), ref)
    row = fp.report(model).models[0].graphs
    assert row["status"] == f"off: {graphs.REASON_NO_CUDA}" and row["replays"] == row["captures"] == 0


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_graph_runner_replays_quantized_models_or_says_why(name, quantized):
    """The runner's logic on CPU with the simulated backend of test_graphs: a quantized model whose weights are
    tensor subclasses is fingerprinted and replayed; layerwise casting's per-module hooks keep it eager, with the
    reason counted. (Real captures: the GPU test below.)"""
    from test_graphs import SimulatedGraphs

    model, inputs, ref = quantized(name)
    fp.patch(model)
    runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", SimulatedGraphs())
    assert torch.equal(forward(model, inputs), ref) and torch.equal(forward(model, inputs), ref)
    stats = runner.stats()
    if name == "layerwise-fp8":
        assert stats["captured"] == 0 and stats["eager"], stats
        assert all("diffusers hook" in reason for reason in stats["eager"]), stats
    else:
        assert stats["captured"] == 1 and stats["replays"] == 1 and not stats["eager"], stats


def test_quanto_cpu_skip_is_still_needed():
    """`quant.quanto_skipped` leaves linears whose width is not a multiple of 8 unquantized on CPU because torch's
    CPU ``_weight_int8pack_mm`` kills the process there. When this starts passing in a child process, drop the skip."""
    code = ("import torch; torch._weight_int8pack_mm(torch.randn(2, 4, dtype=torch.bfloat16), "
            "torch.ones(8, 4, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert child.returncode != 0, "torch._weight_int8pack_mm works at width 4 now: drop quant.quanto_skipped"
    model = build_flux_transformer("flux-tiny")
    assert quant.quanto_skipped(model) == ["x_embedder"]


# --- the benchmark's --quant ------------------------------------------------------------------------------------

TINY = ["--model", "flux-tiny", "--device", "cpu", "--height", "32", "--width", "32", "--steps", "1",
        "--text-tokens", "8", "--no-progress", "--repeats", "1", "--levels", "step"]


def test_bench_quant_runs_and_names_the_backend_in_the_step_table(tmp_path, capsys):
    needs("gguf-q8_0")
    path = tmp_path / "r.json"
    assert bench.main([*TINY, "--modes", "lossless,high", "--quant", "gguf-q8_0", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    c = result["conditions"]
    assert c["quant"] == "gguf-q8_0" and 0 < c["weights_gib"] < quant.weights_gib(build_flux_transformer("flux-tiny"))
    rows = {r["mode"]: r for r in result["step"]["rows"]}
    assert rows["lossless"]["bit_identical"] is True and rows["high"]["bit_identical"] is True
    assert "peak_mem_gib" in rows["lossless"] and rows["lossless"]["fastpath"]["fallback"] > 0
    out = capsys.readouterr().out
    assert f"warm-up excluded; weights gguf-q8_0, {c['weights_gib']:.3g} GiB)" in out


def test_bench_quant_builds_inputs_in_the_compute_dtype(tmp_path):
    """ERNIE-Image's step inputs take the dtype of the model's first weight: built after layerwise casting they
    were float8 and the patch embedding refused them. The bench builds them from the bf16 model first."""
    path = tmp_path / "r.json"
    assert bench.main(["--model", "ernie-image-tiny", "--device", "cpu", "--height", "32", "--width", "32",
                       "--text-tokens", "8", "--repeats", "1", "--modes", "lossless", "--no-progress",
                       "--quant", "layerwise-fp8", "--json", str(path)]) == 0
    rows = {r["mode"]: r for r in json.loads(path.read_text())["step"]["rows"]}
    assert rows["lossless"]["bit_identical"] is True and rows["lossless"]["fastpath"]["sites"] == 2 * 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quant", "bnb-nf4"], "bitsandbytes quantizer needs a CUDA GPU"),
        (["--quant", "torchao-int8", "--dtype", "fp16"], "compute in bf16"),
        (["--quant", "int3"], "invalid choice: 'int3'"),
    ],
)
def test_bench_quant_bad_arguments_are_clear_errors(argv, message, capsys):
    if torch.cuda.is_available() and "bnb" in argv[1]:
        pytest.skip("the no-CUDA refusal")
    with pytest.raises(SystemExit) as exc:
        bench.main([*TINY, *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_unavailable_names_the_missing_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    assert quant.unavailable("gguf-q8_0", CPU) == "needs gguf (pip install gguf)"
    with pytest.raises(RuntimeError, match="needs gguf"):
        quant.quantize(build_flux_transformer("flux-tiny"), "gguf-q8_0", CPU)


# --- GPU ---------------------------------------------------------------------------------------------------------


def _gpu_quantized(name: str):
    """A tiny FLUX every fused kernel takes (head dim 128, the published rotary axes) quantized by `name` on CUDA,
    its inputs and its unpatched output."""
    cuda = torch.device("cuda")
    needs(name, cuda)
    base = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=19, attention_head_dim=128,
                                  num_attention_heads=2, axes_dims_rope=[16, 56, 56])
    inputs = flux_transformer_inputs(base, seed=20, device="cuda")
    model = quant.quantize(base, name, cuda)
    return model, inputs, forward(model, inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_quantized_flux_on_cuda_is_bit_identical_with_every_site_fast(name, unpatch_after):
    model, inputs, ref = _gpu_quantized(name)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(forward(model, inputs), ref)
    rep = fp.report(model)
    refused = HAND_OFF_REFUSED.get(name)  # every non-GEMM site on the fast path, the hand-offs some refuse aside
    assert rep.fast > 0 and all(set(s.reasons) <= {refused} for s in rep.sites), str(rep)
    assert all(not s.reasons or s.op == _handoff.GATED_MODULATE for s in rep.sites), str(rep)
    with fp.quality(model, "high"):
        forward(model, inputs)
        rep = fp.report(model)
    gelu = [s for s in rep.tier_sites if s.op == "linear_gelu"]
    assert gelu and all(not s.mounted and "quantized" in s.cannot for s in gelu), str(rep)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_quantized_flux_on_cuda_graphs_replay_or_say_why(name, unpatch_after):
    model, inputs, ref = _gpu_quantized(name)
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    outs = [forward(model, inputs) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    g = fp.report(model).models[0].graphs
    if name == "layerwise-fp8":  # its per-module hooks run Python on every call
        assert g["replays"] == 0 and any("diffusers hook" in r for r in g["eager"]), g
    else:  # replays, or every eager call says why (a capture that failed names its cause)
        assert g["replays"] >= 1 or (g["eager"] and all(g["eager"].values())), g
        assert g["status"] == "on", g


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_bench_quant_on_cuda_step_table(name, tmp_path):
    needs(name, torch.device("cuda"))
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "flux-tiny", "--height", "128", "--width", "128", "--repeats", "2", "--levels", "step",
                     "--modes", "eager,lossless,lossless+graphs", "--quant", name, "--no-progress",
                     "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    rows = {r["mode"]: r for r in result["step"]["rows"]}
    assert rows["lossless"]["bit_identical"] is True and rows["lossless+graphs"]["bit_identical"] is True
    assert all(rows[m]["peak_mem_gib"] > 0 for m in rows)
    assert result["conditions"]["quant"] == name
