"""The benchmark's parts level (`bench.levels.parts`): the recorder sees every projection and attention call of a step
and sorts them right, each part holds what its name says, and the command reports it (CPU, flux-tiny); on the GPU
the parts are CUDA graphs and the patched step keeps eager's GEMMs and attention."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from diffusers_fastpath import bench
from diffusers_fastpath.bench.levels.parts import FLOOR, PART_CATEGORIES, Recorder, op_category, parts_of
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

from test_bench import TINY


def _linear_calls(model: nn.Module, run) -> tuple[int, int]:
    """(projections of more than 16 rows, projections of at most 16) that ``run()`` makes through nn.Linear."""
    rows = []
    handles = [m.register_forward_pre_hook(lambda mod, args: rows.append(args[0].numel() // args[0].shape[-1]))
               for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return sum(r > 16 for r in rows), sum(r <= 16 for r in rows)


def _record(model, inputs) -> Recorder:
    rec = Recorder(torch.device("cpu"))
    with torch.no_grad(), rec:
        model(**inputs)
    return rec


def _count(ops, category) -> int:
    return sum(op[4] == category for op in ops)


@pytest.fixture(scope="module")
def tiny():
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cpu", seed=0)
    return model, flux_transformer_inputs(model, grid=(4, 4), txt_tokens=8, seed=3)


def test_recorder_sees_every_projection_and_attention_call(tiny):
    """Each nn.Linear call is one GEMM (more than 16 rows) or GEMV (16 or fewer: the adaLN's modulation, the
    embedders); each block attends once; the rest of eager's kernels are elementwise, none of them ours."""
    model, inputs = tiny
    with torch.no_grad():
        gemms, gemvs = _linear_calls(model, lambda: model(**inputs))
    ops = _record(model, inputs).ops
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert (_count(ops, "gemm"), _count(ops, "gemv")) == (gemms, gemvs)
    assert gemms > 0 and gemvs > 0
    assert _count(ops, "attention") == blocks
    assert _count(ops, "fused") == 0 and _count(ops, "elementwise") > 0
    assert any(op[4] is None for op in ops)  # views and allocations: no kernel, kept in every part


def test_patching_keeps_eagers_gemms_and_attention(tiny):
    """The patched step runs the same projections and attention calls as eager (the fused chains replace only
    elementwise work), and fewer other ops."""
    import diffusers_fastpath as fp

    model, inputs = tiny
    eager = _record(model, inputs).ops
    fp.patch(model)
    try:
        patched = _record(model, inputs).ops
    finally:
        fp.unpatch(model)
    for c in FLOOR:
        assert _count(patched, c) == _count(eager, c), c
    assert _count(patched, "elementwise") < _count(eager, "elementwise")


def test_each_part_holds_what_its_name_says(tiny):
    model, inputs = tiny
    ops = _record(model, inputs).ops
    parts = parts_of(ops)
    present = [c for c in PART_CATEGORIES if _count(ops, c)]
    assert list(parts) == ["whole", "floor"] + [f"without {c}" for c in present]
    assert parts["whole"] == ops
    assert all(op[4] is None or op[4] in FLOOR for op in parts["floor"])
    for c in FLOOR:
        assert _count(parts["floor"], c) == _count(ops, c)
    for c in present:
        without = parts[f"without {c}"]
        assert _count(without, c) == 0
        assert len(without) == len(ops) - _count(ops, c)
        assert [op for op in ops if op[4] != c] == without  # the order of the step is kept


@pytest.mark.parametrize("name, make_args, category", [
    ("aten.addmm.default", lambda: (torch.zeros(8), torch.zeros(4, 3), torch.zeros(3, 8)), "gemv"),
    ("aten.addmm.default", lambda: (torch.zeros(8), torch.zeros(17, 3), torch.zeros(3, 8)), "gemm"),
    ("aten.mm.default", lambda: (torch.zeros(16, 3), torch.zeros(3, 8)), "gemv"),
    # the high tier's GEMM with its GELU epilogue is a GEMM
    ("aten._addmm_activation.default", lambda: (torch.zeros(8), torch.zeros(64, 3), torch.zeros(3, 8)), "gemm"),
    ("aten.bmm.default", lambda: (torch.zeros(2, 32, 3), torch.zeros(2, 3, 8)), "gemm"),
    ("aten._scaled_dot_product_cudnn_attention.default", lambda: (), "attention"),
    ("aten._scaled_dot_product_flash_attention_for_cpu.default", lambda: (), "attention"),
    ("diffusers_fastpath._gelu_cat_cuda.default", lambda: (), "fused"),
    ("aten.mul.Tensor", lambda: (), "elementwise"),
    ("aten.empty_strided.default", lambda: (), None),
])
def test_op_category(name, make_args, category):
    assert op_category(name, None, make_args()) == category


def test_views_launch_no_kernel():
    assert op_category("aten.view.default", torch.ops.aten.view.default, (torch.zeros(4), [2, 2])) is None
    assert op_category("aten.transpose.int", torch.ops.aten.transpose.int, ()) is None


def test_parts_level_through_the_command(tmp_path, capsys):
    """``--levels step,parts``: a row per mode and part with its op counts, time and cost; the graphs mode is
    skipped with its reason; the saved run re-renders the same table."""
    path = tmp_path / "r.json"
    rc = bench.main([*TINY, "--repeats", "2", "--levels", "step,parts", "--modes", "eager,lossless,lossless+graphs",
                     "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    parts = result["parts"]
    assert parts["ran"] and parts["graphed"] is False and parts["repeats"] == 2
    assert set(parts["skipped"]) == {"lossless+graphs"} and "CUDA graphs" in parts["skipped"]["lossless+graphs"]
    eager_ms = parts["eager_step_ms"]
    step = {r["mode"]: r for r in result["step"]["rows"]}
    assert eager_ms == step["eager"]["ms"] > 0  # the ratio's reference: eager's step, timed at the step level
    rows = {(r["mode"], r["part"]): r for r in parts["rows"]}
    for mode in ("eager", "lossless"):
        whole = rows[(mode, "whole")]
        assert whole["available"] and len(whole["ms_all"]) == 2 and whole["ms"] > 0
        assert whole["vs_eager_step"] == pytest.approx(whole["ms"] / eager_ms)
        assert whole["cost_ms"] is None and rows[(mode, "floor")]["cost_ms"] is None
        assert rows[(mode, "floor")]["ops"]["elementwise"] == 0
        for c in ("gemm", "gemv", "attention", "elementwise"):
            row = rows[(mode, f"without {c}")]
            assert row["ops"][c] == 0 and row["cost_ms"] == pytest.approx(whole["ms"] - row["ms"])
    report = capsys.readouterr().out
    assert "### The step by parts" in report and "| lossless | floor |" in report
    assert bench.main(["--from-json", str(path)]) == 0
    assert "### The step by parts" in capsys.readouterr().out


def test_a_mode_that_cannot_be_recorded_is_skipped_with_its_reason(tmp_path, monkeypatch):
    """A failing recording costs that mode's rows only: the run goes on and says why."""
    from diffusers_fastpath.bench.levels import parts

    real = parts.parts_of_mode

    def fails_for_lossless(mode, *args):
        if mode.name == "lossless":
            raise RuntimeError("cannot record this")
        return real(mode, *args)

    monkeypatch.setattr(parts, "parts_of_mode", fails_for_lossless)
    path = tmp_path / "r.json"
    assert bench.main([*TINY, "--repeats", "1", "--levels", "parts", "--modes", "eager,lossless", "--json",
                       str(path)]) == 0
    result = json.loads(path.read_text())["parts"]
    assert result["skipped"] == {"lossless": "failed: RuntimeError: cannot record this"}
    assert {r["mode"] for r in result["rows"]} == {"eager"}
    assert result["eager_step_ms"] is None and all(r["vs_eager_step"] is None for r in result["rows"])


@pytest.mark.gpu
def test_parts_level_on_gpu(tmp_path):
    """FLUX.1-dev config at 256x256: every part captured as a CUDA graph; the patched step has this package's
    kernels, eager's GEMMs, GEMVs and attention calls, and fewer elementwise ops; nothing host-side is left out."""
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "flux-dev", "--height", "256", "--width", "256", "--repeats", "2", "--levels",
                     "step,parts", "--modes", "eager,lossless", "--no-progress", "--json", str(path)])
    assert rc == 0
    parts = json.loads(path.read_text())["parts"]
    assert parts["graphed"] is True and not parts["skipped"]
    rows = {(r["mode"], r["part"]): r for r in parts["rows"]}
    assert all(r["available"] and r["ms"] > 0 for r in rows.values()), [r["reason"] for r in rows.values()]
    eager, lossless = rows[("eager", "whole")]["ops"], rows[("lossless", "whole")]["ops"]
    assert eager["fused"] == 0 and lossless["fused"] >= 19 * 4 + 38
    assert all(eager[c] == lossless[c] > 0 for c in FLOOR)
    assert lossless["elementwise"] < eager["elementwise"]
    assert ("lossless", "without fused") in rows and ("eager", "without fused") not in rows
