"""The benchmark command on CPU (flux-tiny, 64x64, 2 steps): every field of the report is there and computed in
the run, a perturbed mode is caught, saved runs re-render, bad arguments are clear errors. GPU checks at the end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath import bench
from diffusers_fastpath.bench.cli import _check_args, _parser
from diffusers_fastpath.bench.levels.profile import idle_gaps

TINY = ["--model", "flux-tiny", "--device", "cpu", "--height", "64", "--width", "64", "--steps", "2",
        "--text-tokens", "8", "--no-progress"]
STEP_FIELDS = {"mode", "available", "reason", "ms", "host_ms", "ms_all", "host_ms_all", "ratio", "peak_mem_gib",
               "first_peak_mem_gib",
               "compile_s", "md5", "bit_identical", "max_abs_diff", "psnr_db", "repeatable", "interleaved", "fastpath", "sensors"}
GEN_FIELDS = {"mode", "available", "reason", "s", "s_all", "host_s", "ratio", "peak_mem_gib", "compile_s", "warmup_s",
              "latents_md5", "image_md5", "image_shape", "bit_identical", "latents_identical", "image_identical",
              "max_abs_diff_latents", "psnr_db", "ssim", "repeatable", "interleaved", "fastpath", "split",
              "split_ratio", "split_all"}
SPLIT_FIELDS = {"clock", "text_encoded", "text_ms", "denoise_ms", "decode_ms", "other_ms", "total_ms"}
CONDITION_FIELDS = {"device", "gpu", "driver", "torch", "cuda", "diffusers", "diffusers_fastpath", "dtype", "height",
                    "width", "steps", "batch", "text_tokens", "model", "commit", "date", "quant", "weights_gib"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # These models are tiny: with the two cores shared by other jobs, OpenMP's thread handoff costs 100x the math.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _perturb(model, ctx):
    """A deliberately inexact mode: nudges the transformer's output by one bf16 step near 1."""

    def hook(module, args, out):
        return (out[0] + 2**-7, *out[1:]) if isinstance(out, tuple) else out.__class__(sample=out.sample + 2**-7)

    return model.register_forward_hook(hook).remove


PERTURBED = bench.Mode("perturbed", "test: output + 2^-7", _perturb)
MISSING = bench.Mode("missing", "test: never available", bench.MODES["eager"].apply,
                     unavailable=lambda ctx: "a prerequisite this test leaves out")


def _boom(model, ctx):
    raise RuntimeError("boom")


BROKEN = bench.Mode("broken", "test: fails to apply", _boom)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run of every level on CPU with the perturbed and the unavailable test modes registered."""
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench.MODES, PERTURBED.name, PERTURBED)
        mp.setitem(bench.MODES, MISSING.name, MISSING)
        mp.setitem(bench.MODES, BROKEN.name, BROKEN)
        rc = bench.main([*TINY, "--repeats", "2", "--modes", "lossless,perturbed,missing,broken", "--kernels",
                         "--profile",
                         "--json", str(out / "run.json"), "--markdown", str(out / "run.md")])
    return dict(rc=rc, json=out / "run.json", result=json.loads((out / "run.json").read_text()),
                markdown=(out / "run.md").read_text())


def _rows(result, level):
    return {r["mode"]: r for r in result[level]["rows"]}


def test_json_has_every_field(tiny_run):
    result = tiny_run["result"]
    assert tiny_run["rc"] == 0
    assert result["schema"] == bench.SCHEMA
    assert CONDITION_FIELDS <= result["conditions"].keys()
    c = result["conditions"]
    assert (c["model"], c["height"], c["width"], c["steps"], c["dtype"]) == ("flux-tiny", 64, 64, 2, "bfloat16")
    assert c["quant"] == "none" and 0 < c["weights_gib"] < 0.01  # the tiny FLUX's bf16 weights
    assert c["commit"] and c["torch"] == torch.__version__
    assert result["args"]["repeats"] == 2 and result["levels"] == ["step", "generation", "profile", "kernels"]
    assert list(result["modes"]) == ["eager", "lossless", "perturbed", "missing", "broken"]
    for name in ("eager", "lossless", "perturbed"):
        assert STEP_FIELDS == _rows(result, "step")[name].keys()
        assert GEN_FIELDS == _rows(result, "generation")[name].keys()
    assert result["generation"]["rows"][0]["image_shape"] == [1, 64, 64, 3]
    assert {p["mode"] for p in result["profile"]["rows"]} == {"eager", "lossless", "perturbed"}
    for p in result["profile"]["rows"]:
        assert set(p["categories"]) == set(bench.CATEGORY_NAMES)
        assert p["kernels"] == sum(c["count"] for c in p["categories"].values()) > 0
        assert p["categories"]["gemm"]["count"] > 0 and p["categories"]["attention"]["count"] > 0
    assert result["kernels"]["ran"] is False and "CUDA" in result["kernels"]["reason"]
    assert {"build", "step", "generation"} <= result["phases_s"].keys()


def test_lossless_is_bit_identical_to_eager_on_cpu(tiny_run):
    result = tiny_run["result"]
    for level in ("step", "generation"):
        eager, lossless = _rows(result, level)["eager"], _rows(result, level)["lossless"]
        assert eager["bit_identical"] is True and lossless["bit_identical"] is True and lossless["psnr_db"] == "inf"
        assert len(lossless["ms_all" if level == "step" else "s_all"]) == (2 if level == "step" else 1)
    step = _rows(result, "step")["lossless"]
    assert step["md5"] == _rows(result, "step")["eager"]["md5"] and step["max_abs_diff"] == 0
    # the patched model really was in place: every site counted its calls (eager fallbacks on CPU)
    # tiny FLUX: 2 dual blocks (8 sites each), 2 single (3 each, the first without its token cat), 4 attentions (2),
    # 2 joint value projections, 7 fused update + LayerNorm-modulates (`models._handoff`)
    assert step["fastpath"]["sites"] == 2 * 8 + 2 * 4 - 1 + 4 * 2 + 2 + 7 and step["fastpath"]["fallback"] > 0
    assert _rows(result, "step")["eager"]["fastpath"] is None
    gen = _rows(result, "generation")["lossless"]
    assert gen["latents_md5"] == _rows(result, "generation")["eager"]["latents_md5"] and gen["ssim"] == 1.0


def test_perturbed_mode_is_reported_not_bit_identical(tiny_run):
    result = tiny_run["result"]
    step, eager = _rows(result, "step")["perturbed"], _rows(result, "step")["eager"]
    assert step["bit_identical"] is False and step["md5"] != eager["md5"]
    assert step["max_abs_diff"] > 0 and math.isfinite(step["psnr_db"])
    gen = _rows(result, "generation")["perturbed"]
    assert gen["bit_identical"] is False and gen["latents_identical"] is False
    assert gen["latents_md5"] != _rows(result, "generation")["eager"]["latents_md5"]
    assert math.isfinite(gen["psnr_db"]) and gen["ssim"] < 1.0
    assert "| perturbed |" in tiny_run["markdown"] and "**no**" in tiny_run["markdown"]


def test_eager_md5_is_the_md5_of_the_real_step_output(tiny_run):
    """The md5 in the report is computed from the model's output, not copied: recompute it independently."""
    from diffusers_fastpath.testing import build_flux_transformer, flux_pipeline, prompt_embeddings

    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cpu", seed=0)
    pipe = flux_pipeline(model, None)
    pipe.set_progress_bar_config(disable=True)
    emb = prompt_embeddings(pipe, batch=1, txt_tokens=8, seed=2)
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    with torch.no_grad():
        pipe(**emb, height=64, width=64, num_inference_steps=1, output_type="latent",
             generator=torch.Generator().manual_seed(3))
    assert bench.md5(seen[0]) == _rows(tiny_run["result"], "step")["eager"]["md5"]


def test_generation_time_split(tiny_run):
    """Every generation row splits its call into text encoding (not run: embeddings given), denoising and decode,
    each measured (host clock on a CPU) and non-negative, their sum within the end-to-end time of the same call, with
    each part's ratio against eager's; the patched modes' latents are eager's; the report shows the split and names
    the models each mode patched (the pipeline's transformer and its VAE)."""
    result, md = tiny_run["result"], tiny_run["markdown"]
    rows = _rows(result, "generation")
    for name in ("eager", "lossless", "perturbed"):
        split = rows[name]["split"]
        assert split.keys() == SPLIT_FIELDS and split["clock"] == "host clock (CPU)"
        assert split["text_encoded"] is False
        assert 0 <= split["text_ms"] and 0 < split["denoise_ms"] and 0 < split["decode_ms"] and 0 <= split["other_ms"]
        parts = split["text_ms"] + split["denoise_ms"] + split["decode_ms"]
        assert parts <= split["total_ms"] and split["other_ms"] == pytest.approx(split["total_ms"] - parts)
        assert split["total_ms"] == pytest.approx(rows[name]["s"] * 1e3)  # one timed call: the split is that call's
        for call in rows[name]["split_all"]:
            assert call["text"] + call["denoise"] + call["decode"] <= call["total"]
        ratio = rows[name]["split_ratio"]
        assert ratio["denoise"] == pytest.approx(split["denoise_ms"] / rows["eager"]["split"]["denoise_ms"])
        assert ratio["total"] == pytest.approx(rows[name]["ratio"])
    assert rows["lossless"]["latents_md5"] == rows["eager"]["latents_md5"]
    assert rows["lossless"]["image_md5"] == rows["eager"]["image_md5"]
    # the generation patches the pipeline as a user does: fp.patch(pipe) takes its transformer and its VAE
    models = {m["name"]: m for m in rows["lossless"]["fastpath"]["models"]}
    assert models.keys() == {"transformer", "vae"} and rows["eager"]["fastpath"] is None
    assert (models["transformer"]["class"], models["vae"]["class"]) == ("FluxTransformer2DModel", "AutoencoderKL")
    assert models["vae"]["sites"] > 0 and models["vae"]["fallback"] > 0  # its GroupNorms ran (eager on a CPU)
    assert rows["lossless"]["fastpath"]["sites"] == models["transformer"]["sites"] + models["vae"]["sites"]
    line = next(l for l in md.splitlines() if l.startswith("| lossless |") and "FluxTransformer2DModel" in l)
    assert f"transformer (FluxTransformer2DModel) {models['transformer']['sites']} (" in line
    assert f"vae (AutoencoderKL) {models['vae']['sites']} (" in line
    assert "Time split of the call with the median end-to-end time (host clock (CPU)" in md
    assert "| mode | text encoding | denoising (transformer + scheduler) | decode (VAE) | other | end to end |" in md
    split_line = next(l for l in md.splitlines() if l.startswith("| lossless | not run ("))
    assert f"{rows['lossless']['split']['decode_ms']:.2f} (" in split_line
    # the step level still patches the transformer alone
    assert [m["class"] for m in _rows(result, "step")["lossless"]["fastpath"]["models"]] == ["FluxTransformer2DModel"]


def test_split_marks_the_parts_without_changing_what_runs(emulated_kernels, unpatch_after):
    """The split's marks are wrappers on the pipeline and VAE instances for the call only: under them a patched
    FLUX.1 pipeline (emulated kernels) takes the same fast paths at every site, FLUX.1's hand-offs between blocks
    and the VAE's GroupNorm + SiLU pairs included (a module hook there would make them refuse), gives the same bits,
    and nothing of the wrappers is left afterwards. Each part is where its time went: a sleep put in the VAE's
    decoder lands in decode, one in each transformer step in denoising."""
    import time as time_module

    import diffusers_fastpath as fp
    from diffusers_fastpath.bench.levels.generation import split_parts
    from diffusers_fastpath.testing import prompt_embeddings, tiny_flux_pipeline

    pipe = fp.patch(tiny_flux_pipeline())
    unpatch_after(pipe)
    pipe.set_progress_bar_config(disable=True)
    emb = prompt_embeddings(pipe, batch=1, txt_tokens=8, seed=2)

    def call():
        with torch.no_grad():
            return pipe(**emb, height=64, width=64, num_inference_steps=2, output_type="pt",
                        generator=torch.Generator().manual_seed(3)).images

    def counters():
        rep = fp.report(pipe)
        return {(r.model, r.site): (r.fast, r.fallback) for r in rep.sites}

    def delta(before, after):
        return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}

    c0 = counters()
    plain = call()
    c1 = counters()
    with split_parts(pipe, cuda=False) as split:
        marked = call()
        parts = split()
    c2 = counters()
    assert torch.equal(plain, marked)
    assert delta(c0, c1) == delta(c1, c2)
    marked_calls = delta(c1, c2)
    pairs = [k for k in marked_calls if k[0] == "vae" and k[1].startswith("decoder") and ":group_norm_silu" in k[1]]
    handoffs = [k for k in marked_calls if k[0] == "transformer" and k[1].endswith(":gated")]  # `models._handoff`
    assert pairs and all(marked_calls[k][0] > 0 and marked_calls[k][1] == 0 for k in pairs), marked_calls
    assert handoffs and all(marked_calls[k][0] > 0 and marked_calls[k][1] == 0 for k in handoffs), marked_calls
    assert {"encode_prompt", "progress_bar"}.isdisjoint(pipe.__dict__) and "decode" not in pipe.vae.__dict__
    assert all(parts[p] is not None and parts[p] >= 0 for p in ("text", "denoise", "decode"))
    # what the counters would show had the marks been module hooks: the hand-offs and the pairs refuse
    hooks = [pipe.transformer.transformer_blocks[1].register_forward_hook(lambda m, a, o: None),
             pipe.vae.decoder.up_blocks[0].resnets[0].norm1.register_forward_hook(lambda m, a, o: None)]
    call()
    for h in hooks:
        h.remove()
    hooked = delta(c2, counters())
    assert any(hooked[k][1] > 0 for k in handoffs) and hooked[("vae", pairs[0][1])][1] > 0, hooked

    pipe.vae.decoder.register_forward_pre_hook(lambda m, a: time_module.sleep(0.3))
    pipe.transformer.register_forward_pre_hook(lambda m, a, k: time_module.sleep(0.1), with_kwargs=True)
    with split_parts(pipe, cuda=False) as split:
        call()
        parts = split()
    assert 300 <= parts["decode"] < 300 + 100 * 2  # the decoder's sleep, not the steps'
    assert 200 <= parts["denoise"] < 200 + 300  # both steps' sleeps, not the decoder's
    assert parts["text"] < 100


def test_unavailable_mode_is_reported_with_its_reason(tiny_run):
    result = tiny_run["result"]
    assert result["modes"]["missing"] == dict(description=MISSING.description, exact=False, compiled=False,
                                              available=False, reason="a prerequisite this test leaves out")
    row = _rows(result, "step")["missing"]
    assert row == dict(mode="missing", available=False, reason="a prerequisite this test leaves out")
    assert "| missing | unavailable: a prerequisite this test leaves out |" in tiny_run["markdown"]


def test_a_mode_that_fails_is_reported_and_the_run_goes_on(tiny_run):
    result = tiny_run["result"]
    assert result["modes"]["broken"]["available"] is False
    assert result["modes"]["broken"]["reason"] == "failed: RuntimeError: boom"
    assert _rows(result, "generation")["broken"] == dict(mode="broken", available=False,
                                                         reason="failed: RuntimeError: boom")


def test_high_mode_is_available_exactly_when_the_tier_exists():
    from diffusers_fastpath._state import QUALITIES

    reason = bench.MODES["high"].unavailable(bench.Context(torch.device("cpu")))
    assert (reason is None) == ("high" in QUALITIES)
    if reason is not None:
        assert "QUALITIES" in reason


def test_markdown_lists_every_mode_and_the_conditions(tiny_run):
    md = tiny_run["markdown"]
    for name in ("eager", "lossless", "perturbed"):
        assert md.count(f"| {name} |") == 4, name  # step, generation (and its time split) and profile tables
    assert md.count("| missing |") == 2  # unavailable: in the timing tables, with its reason
    c = tiny_run["result"]["conditions"]
    assert f"torch {c['torch']}" in md and f"commit `{c['commit']}`" in md and "64x64" in md
    assert "Kernels level: needs CUDA" in md


def test_profile_table_says_what_fusion_removed_outside_gemms_and_attention(tiny_run):
    """Each profiled mode's time outside GEMMs, convolutions and attention, and the share of eager's that it no longer
    spends (the families' goal metric), computed from the row's own categories."""
    from diffusers_fastpath.bench.render import profile_tables, rest_ms

    rows = {p["mode"]: p for p in tiny_run["result"]["profile"]["rows"]}
    eager, lossless = rest_ms(rows["eager"]), rest_ms(rows["lossless"])
    c = rows["lossless"]["categories"]
    floor = ("gemm", "conv", "attention")
    assert lossless == pytest.approx(sum(c[n]["ms"] for n in bench.CATEGORY_NAMES if n not in floor))
    line = next(l for l in tiny_run["markdown"].splitlines() if l.startswith("| lossless |") and f"{lossless:.2f} (" in l)
    assert line.endswith(f"{lossless:.2f} ({1 - lossless / eager:.0%}) |")
    assert "outside GEMMs, convolutions and attention: ms (removed)" in tiny_run["markdown"]
    # a saved run from before the conv categories re-renders (their cells read 0)
    old = {**rows["lossless"], "categories": {k: v for k, v in c.items() if "conv" not in k}}
    assert rest_ms(old) == pytest.approx(lossless) and "| 0 / 0.00 |" in "\n".join(profile_tables([old]))


def test_profile_json_keeps_more_kernels_than_the_report_lists():
    """The JSON keeps the `PROFILE_TOP` costliest kernels by name (a step's memsets and small copies among them, to
    tell eager's from the patched step's); the report lists the first `PROFILE_SHOWN` and says how many the JSON has."""
    from diffusers_fastpath.bench.levels.profile import PROFILE_SHOWN, PROFILE_TOP
    from diffusers_fastpath.bench.render import profile_tables

    assert PROFILE_TOP > PROFILE_SHOWN
    cats = {n: {"count": 0, "ms": 0.0} for n in bench.CATEGORY_NAMES}
    top = [dict(name=f"kernel_{i}", category="other", count=1, ms=float(40 - i)) for i in range(PROFILE_SHOWN + 5)]
    text = "\n".join(profile_tables([dict(mode="eager", kernels=len(top), ms=0.0, categories=cats, top=top)]))
    assert f"the {PROFILE_SHOWN} kernels that took the most time (the JSON keeps {PROFILE_SHOWN + 5})" in text
    assert f"`kernel_{PROFILE_SHOWN - 1}`" in text and f"`kernel_{PROFILE_SHOWN}`" not in text
    few = "\n".join(profile_tables([dict(mode="eager", kernels=3, ms=0.0, categories=cats, top=top[:3])]))
    assert "the 3 kernels that took the most time</summary>" in few


def test_step_peak_is_the_timed_calls_and_a_higher_first_call_is_said():
    """The step's peak memory is its timed calls'; the first call's (a patched model's verification forward) is shown
    beside it only where it was higher, and a saved run without it renders as before."""
    from diffusers_fastpath.bench.render import _peak

    assert _peak({"peak_mem_gib": 28.46, "first_peak_mem_gib": 32.13}) == "28.46 (first call 32.13)"
    assert _peak({"peak_mem_gib": 28.46, "first_peak_mem_gib": 28.46}) == "28.46"
    assert _peak({"peak_mem_gib": 28.46}) == "28.46" and _peak({"peak_mem_gib": None}) == "-"


def test_from_json_re_renders_the_same_report(tiny_run, capsys):
    capsys.readouterr()
    assert bench.main(["--from-json", str(tiny_run["json"])]) == 0
    assert capsys.readouterr().out == tiny_run["markdown"]


def test_a_broken_promise_of_bit_identity_sets_exit_status_1(monkeypatch, capsys):
    liar = bench.Mode("liar", "test: claims exactness, perturbs", _perturb, exact=True)
    monkeypatch.setitem(bench.MODES, liar.name, liar)
    assert bench.main([*TINY, "--repeats", "1", "--levels", "step", "--modes", "liar"]) == 1
    assert "FAILED: step: mode liar is not bit-identical to eager" in capsys.readouterr().out


def test_compile_mode_runs_and_reports_compile_time(capsys, tmp_path):
    # The "eager" dynamo backend traces without generating code: fast on CPU, and bit-identical by construction.
    rc = bench.main([*TINY, "--repeats", "1", "--levels", "step", "--modes", "compile", "--compile-backend", "eager",
                     "--json", str(tmp_path / "r.json")])
    assert rc == 0
    row = _rows(json.loads((tmp_path / "r.json").read_text()), "step")["compile"]
    assert row["compile_s"] > 0 and row["interleaved"] is False and row["bit_identical"] is True


def test_modes_undo_what_they_apply():
    from diffusers_fastpath._state import STATE_ATTR
    from diffusers_fastpath.testing import build_flux_transformer

    model = build_flux_transformer("flux-tiny")
    cls = type(model)
    ctx = bench.Context(torch.device("cpu"), {"backend": "eager"})
    undo = bench.MODES["lossless+compile"].apply(model, ctx)
    assert model._compiled_call_impl is not None and STATE_ATTR in model.__dict__
    undo()
    assert model._compiled_call_impl is None and STATE_ATTR not in model.__dict__ and type(model) is cls


def test_patch_modes_patch_the_context_pipeline_whole():
    """With the pipeline in the context (the generation level), a patching mode patches it as a user does: its
    transformer and its VAE, both undone; without it (the step level), the transformer alone."""
    from diffusers_fastpath._state import STATE_ATTR
    from diffusers_fastpath.testing import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    for ctx, patched in ((bench.Context(torch.device("cpu"), pipe=pipe), {"transformer", "vae"}),
                         (bench.Context(torch.device("cpu")), {"transformer"})):
        undo = bench.MODES["lossless"].apply(pipe.transformer, ctx)
        assert {n for n in ("transformer", "vae") if STATE_ATTR in getattr(pipe, n).__dict__} == patched
        undo()
        assert not any(STATE_ATTR in getattr(pipe, n).__dict__ for n in ("transformer", "vae"))


def test_ernie_image_step_level_on_cpu(tmp_path):
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "ernie-image-tiny", "--device", "cpu", "--height", "32", "--width", "32",
                     "--text-tokens", "8", "--repeats", "1", "--modes", "lossless", "--no-progress",
                     "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert _rows(result, "step")["lossless"]["bit_identical"] is True
    assert _rows(result, "step")["lossless"]["fastpath"]["sites"] == 2 * 2  # two adaLN sites per layer
    assert result["generation"]["ran"] is False and "ERNIE-Image" in result["generation"]["reason"]


def test_chroma_step_and_generation_on_cpu(tmp_path):
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "chroma-tiny", "--device", "cpu", "--height", "64", "--width", "64", "--steps", "2",
                     "--text-tokens", "8", "--repeats", "1", "--modes", "lossless", "--no-progress", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    lossless = _rows(result, "step")["lossless"]
    assert lossless["bit_identical"] is True and lossless["fastpath"]["sites"] == 32  # 2 dual + 2 single blocks
    assert _rows(result, "generation")["lossless"]["bit_identical"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA (with it, a CPU model's graphs mode is "
                    "on and its calls run eager, counted per call)")
def test_a_graphs_mode_that_did_not_replay_says_why(tmp_path):
    """Without CUDA the graphs mode runs eager: its row carries the runner's status and the report says so under the
    step table (on the GPU the same line tells a failed capture from a replayed step)."""
    path, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = bench.main([*TINY, "--levels", "step", "--modes", "lossless+graphs", "--json", str(path), "--markdown", str(md)])
    assert rc == 0
    graphs = _rows(json.loads(path.read_text()), "step")["lossless+graphs"]["fastpath"]["graphs"]
    assert graphs["status"].startswith("off") and graphs["replays"] == 0 and graphs["captured"] == 0
    assert "lossless+graphs: CUDA graphs off" in md.read_text()


def test_flux2_step_and_generation_on_cpu(tmp_path):
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "flux2-tiny", "--device", "cpu", "--height", "64", "--width", "64", "--steps", "2",
                     "--text-tokens", "8", "--repeats", "1", "--modes", "lossless", "--no-progress", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    lossless = _rows(result, "step")["lossless"]
    assert lossless["bit_identical"] is True and lossless["fastpath"]["sites"] == 34  # 2 dual + 2 single blocks
    gen = _rows(result, "generation")["lossless"]
    assert gen["bit_identical"] is True and gen["image_identical"] is True and gen["image_shape"] == [1, 64, 64, 3]


def test_flux2_klein_step_builds_the_vae_its_pipeline_reads(tmp_path):
    """Flux2KleinPipeline reads its VAE's latent statistics at every call, output_type="latent" included: the step
    level alone (no generation) still gives the klein pipeline a VAE (the H200 run at 4f6d200 failed without one)."""
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "flux2-klein-tiny", "--device", "cpu", "--height", "64", "--width", "64",
                     "--text-tokens", "8", "--repeats", "1", "--modes", "lossless", "--levels", "step", "--no-progress",
                     "--json", str(path)])
    assert rc == 0
    lossless = _rows(json.loads(path.read_text()), "step")["lossless"]
    assert lossless["bit_identical"] is True and lossless["fastpath"]["sites"] == 34


@pytest.mark.parametrize("model, cfg", [("ltx-video-tiny", True), ("ltx-video-distilled-tiny", False)])
def test_ltx_video_generation_on_cpu(model, cfg, tmp_path):
    """LTX-Video's whole generation (a tiny AutoencoderKLLTXVideo of the published 32x, 8-frame compression): the
    base model's call with classifier-free guidance (one batch-2 step), the distilled one's without; bit-identical,
    the decode in the split, the video's frames in the md5."""
    path = tmp_path / "r.json"
    rc = bench.main(["--model", model, "--device", "cpu", "--height", "64", "--width", "64", "--frames", "9",
                     "--steps", "2", "--text-tokens", "8", "--repeats", "1", "--modes", "lossless", "--no-progress",
                     "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert _rows(result, "step")["lossless"]["bit_identical"] is True
    gen = _rows(result, "generation")
    assert gen["lossless"]["bit_identical"] is True and gen["lossless"]["image_shape"] == [1, 9, 64, 64, 3]
    assert gen["lossless"]["latents_md5"] == gen["eager"]["latents_md5"]
    assert gen["eager"]["split"]["decode_ms"] > 0 and gen["eager"]["split"]["denoise_ms"] > 0
    models = {m["name"]: m["class"] for m in gen["lossless"]["fastpath"]["models"]}
    assert models["transformer"] == "LTXVideoTransformer3DModel"
    p = _parser()
    args = p.parse_args(["--model", model, "--device", "cpu", "--height", "64", "--width", "64", "--frames", "9",
                         "--steps", "1", "--text-tokens", "8"])
    _check_args(p, args)
    subject = bench.build_subject(args, torch.device("cpu"), need_vae=False)
    assert subject.step_inputs["hidden_states"].shape[0] == (2 if cfg else 1)  # prompt and negative prompt in one


def test_flux_schnell_and_few_step_defaults():
    """FLUX.1-schnell is FLUX.1-dev's config without the guidance embedding, with FLUX.1's VAE; the distilled models'
    defaults make a few-step run one command (their published steps, prompt length and, for LTX-Video, size)."""
    from diffusers_fastpath.bench.subject import PIPELINE_MODELS
    from diffusers_fastpath.testing.flux import FLUX_CONFIGS

    assert FLUX_CONFIGS["flux-schnell"] == dict(FLUX_CONFIGS["flux-dev"], guidance_embeds=False)
    assert PIPELINE_MODELS["flux-schnell"] == ("flux", "flux-schnell", "flux-dev")
    p = _parser()
    for model, want in (("flux-schnell", (4, 256, 1024, 1024)), ("flux2-klein", (4, 512, 1024, 1024)),
                        ("ltx-video-distilled", (8, 128, 512, 768)), ("ltx-video", (50, 128, 512, 768)),
                        ("flux-dev", (28, 512, 1024, 1024))):
        args = p.parse_args(["--model", model, "--device", "cpu", "--levels", "generation"])
        _check_args(p, args)
        assert (args.steps, args.text_tokens, args.height, args.width) == want, model
        assert args.frames == (121 if model.startswith("ltx") else 81)
    args = p.parse_args(["--model", "flux-schnell", "--device", "cpu", "--steps", "2"])
    _check_args(p, args)
    assert args.steps == 2


def test_ltx_video_vae_level_on_cpu(tmp_path):
    """The VAE level takes a video VAE's [B, C, frames, H, W] latents: LTX-Video's (models/vae_ltx.py), patched."""
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "ltx-video-tiny", "--device", "cpu", "--height", "64", "--width", "64", "--frames",
                     "9", "--levels", "vae", "--profile", "--repeats", "1", "--no-progress", "--json", str(path),
                     "--markdown", str(tmp_path / "r.md")])
    assert rc == 0
    result = json.loads(path.read_text())
    vae = result["vae"]
    # --profile beside the VAE level alone profiles the VAE's calls, not a transformer step (none is built)
    assert result["profile"]["ran"] is False and result["conditions"]["weights_gib"] is None
    for call in ("decode", "encode"):
        rows = {p["mode"]: p for p in vae["profile"][call]}
        assert rows.keys() == {"eager", "patched"}
        for p in rows.values():  # its causal 3-D convolutions, counted apart from the rest
            assert p["categories"]["conv"]["count"] > 0 and p["kernels"] == sum(
                c["count"] for c in p["categories"].values())
    assert "### Profile of one VAE decode" in (tmp_path / "r.md").read_text()
    assert vae["ran"], vae.get("reason")
    rows = {r["call"]: r for r in vae["rows"]}
    assert rows["decode"]["input_shape"] == [1, 128, 2, 2, 2] and rows["encode"]["input_shape"] == [1, 3, 9, 64, 64]
    assert all(r["bit_identical"] for r in vae["rows"])
    # its 22 weightless norms (each with a site of its own and its pair's with the SiLU after it), the 30 causal
    # convolutions and their 30 biases, and the 22 convolutions after the pairs' SiLUs (the norm -> SiLU ->
    # convolution chains)
    assert vae["sites"]["sites"] == 2 * 22 + 30 + 30 + 22
    assert vae["sites"]["reasons"] == {"device cpu": vae["sites"]["fallback"]}


@pytest.mark.parametrize("model", ["sd3-tiny", "qwen-image-tiny", "hunyuan-image-tiny", "wan-tiny",
                                   "z-image-tiny", "lumina2-tiny", "hunyuanvideo-1.5-tiny"])
def test_step_only_families_on_cpu(model, tmp_path):
    path = tmp_path / "r.json"
    rc = bench.main(["--model", model, "--device", "cpu", "--height", "64", "--width", "64", "--text-tokens", "8",
                     "--repeats", "1", "--modes", "lossless", "--no-progress", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert _rows(result, "step")["lossless"]["bit_identical"] is True and _rows(result, "step")["lossless"]["fastpath"]["sites"] > 0
    assert result["generation"]["ran"] is False and model in result["generation"]["reason"]


@pytest.mark.parametrize("model, tokens", [("lumina2", 256), ("lumina2-tiny", 32), ("flux-dev", 512),
                                           ("ernie-image", 120), ("z-image", 512), ("flux-schnell", 256),
                                           ("ltx-video", 128)])
def test_default_text_tokens_fit_the_model(model, tokens):
    p = _parser()
    args = p.parse_args(["--model", model, "--device", "cpu"])
    _check_args(p, args)
    assert args.text_tokens == tokens
    args = p.parse_args(["--model", model, "--device", "cpu", "--text-tokens", "77"])
    _check_args(p, args)
    assert args.text_tokens == 77


def test_compiled_modes_are_left_out_by_default_on_cpu():
    p = _parser()
    args = p.parse_args(TINY)
    _check_args(p, args)
    assert args.modes == [m for m in bench.MODES if not bench.MODES[m].compiled]
    args = p.parse_args([*TINY, "--compile-backend", "eager"])
    _check_args(p, args)
    assert args.modes == list(bench.MODES)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--modes", "eager,turbo"], "unknown mode(s) turbo"),
        (["--levels", "step,warp"], "unknown level(s) warp"),
        (["--height", "100"], "--height must be a positive multiple of 16"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--model", "not a model"], "--model 'not a model'"),
        (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    ],
)
def test_bad_arguments_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*TINY, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_running(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as exc:
        bench.main([*TINY, "--plot", "x.png"])
    assert exc.value.code == 2 and "pip install matplotlib" in capsys.readouterr().err


def test_plot_from_json(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    assert bench.main(["--from-json", str(tiny_run["json"]), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize(
    "name, category",
    [
        ("void diffusers_fastpath::(anonymous namespace)::modulate_scale_shift_kernel<__nv_bfloat16>(...)", "fused"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(...)", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)", "norm"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)", "copy/cat"),
        ("Memcpy DtoD (Device -> Device)", "copy/cat"),
        ("void at::native::elementwise_kernel<128, 4, ...direct_copy_kernel_cuda...>(...)", "copy/cat"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl...>(...)", "elementwise"),
        ("triton_poi_fused_add_mul_0", "elementwise"),
        ("triton_per_fused_native_layer_norm_1", "norm"),
        ("triton_poi_fused_cat_3", "copy/cat"),
        ("aten::addmm", "gemm"),
        ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_"
         "execute_segment_k_off_kernel__5x_cudnn", "conv"),
        ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false>(...)",
         "conv layout"),
        ("void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(...)", "conv"),
        ("aten::conv3d", "conv"),
        ("triton_poi_fused__to_copy_convert_element_type_0", "copy/cat"),
        ("aten::mul", "elementwise"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_profile_categories(name, category):
    assert bench.categorize(name) == category


def test_python_dash_m_smoke():
    out = subprocess.run(
        [sys.executable, "-m", "diffusers_fastpath.bench", *TINY, "--repeats", "1", "--levels", "step"],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join([str(Path(bench.__file__).resolve().parents[2]),
                                            *filter(None, [os.environ.get("PYTHONPATH")])])},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| lossless |" in out.stdout and "[bench] step:" in out.stderr


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_bench_kernels_at_flux_dev_and_ernie_shapes_are_equal(tmp_path):
    flux_ops = {"modulate_scale_shift", "layernorm_scale_shift", "gated_residual", "gated_layernorm_scale_shift",
                "rotary_emb", "qk_norm_rope", "qk_norm_rope (text+image)", "linear_gelu (high)", "gelu_cat",
                "linear_cat", "group_norm_silu"}  # (the VAE decoder's GroupNorm + SiLU, FLUX.1's and FLUX.2's)
    sd3_ops = {"layernorm_scale_shift", "gated_residual", "rmsnorm (image q)", "rmsnorm (text q)", "cat_heads"}
    qwen_ops = {"layernorm_scale_shift", "gated_residual", "rmsnorm_rope_complex (image q)",
                "rmsnorm_rope_complex (text q)", "rmsnorm_rope_complex_cat (text+image q)"}
    for model, ops in (("flux-dev", flux_ops), ("ernie-image", {"rmsnorm_scale_shift", "gated_rmsnorm_scale_shift"}),
                       ("sd3-tiny", sd3_ops),  # SD3's head_dim 64 at 1024x1024's 4096 image tokens
                       ("qwen-image-tiny", qwen_ops), ("ltx-video-tiny", {"rmsnorm_modulate", "rotary_emb_rows (q)", "qk_norm_rows_rope (q)",
                                          "qk_norm_rows_rope_pair (q, k)"}),
                       ("flux2-klein", {"layernorm_scale_shift", "gated_residual", "qk_norm_rope (text+image)",
                                        "qk_norm_rope", "silu_mul", "group_norm_silu"})):
        path = tmp_path / f"{model}.json"
        size = ["--height", "1024", "--width", "1024"]  # the tiny models' default is smaller
        assert bench.main(["--model", model, "--levels", "kernels", "--no-progress", *size, "--json", str(path)]) == 0
        kern = json.loads(path.read_text())["kernels"]
        assert kern["ran"] and {r["op"] for r in kern["rows"]} == ops
        assert all(r["equal"] for r in kern["rows"] if r["exact"]), kern["rows"]
        assert all(r["fused_us"] > 0 and 0 < r["pct_of_copy"] and r["graphed"] for r in kern["rows"])
        assert all(0 < r["max_abs_diff"] < 0.25 for r in kern["rows"] if not r["exact"]), kern["rows"]
        from diffusers_fastpath.ops import _build
        # the NVRTC way adds its launcher, the call the public entry makes there
        assert len(kern["host_us_per_call"]) == 5 + (_build.backend == "nvrtc"), kern["host_us_per_call"]
    rows = json.loads((tmp_path / "flux-dev.json").read_text())["kernels"]["rows"]
    shapes = [r["shape"] for r in rows if r["op"] == "modulate_scale_shift"]
    assert shapes == [[1, 4096, 3072], [1, 512, 3072], [1, 4608, 3072]]  # image, text, single at 1024x1024
    rows = json.loads((tmp_path / "sd3-tiny.json").read_text())["kernels"]["rows"]
    assert [r["shape"][2:] for r in rows if r["op"].startswith("rmsnorm")] == [[4096, 64], [512, 64]]


@pytest.mark.gpu
def test_bench_kernels_recorded_from_a_zoo_step_are_equal(tmp_path):
    """The kernels level of models without hand-written cases: the fused calls of one lossless step, each kernel
    equal to its eager reference (outputs poisoned through the allocator), timed as replayed graphs, counted per
    step."""
    for model, ops in (("zoo:flux3-tiny", {"layernorm_modulate", "gated_residual", "silu_mul"}),
                       ("zoo:sana-tiny", {"layernorm_scale_shift", "gated_residual", "silu_mul"}),
                       ("zoo:wan-vace-tiny", {"layernorm_scale_shift_fp32", "gated_residual_fp32"})):
        path = tmp_path / "k.json"
        assert bench.main(["--model", model, "--levels", "kernels", "--no-progress", "--json", str(path)]) == 0
        kern = json.loads(path.read_text())["kernels"]
        assert kern["ran"] and ops <= {r["op"] for r in kern["rows"]}, (model, kern["rows"])
        assert all(r["equal"] and r["source"] == "recorded" and r["calls"] >= 1 for r in kern["rows"]), kern["rows"]
        assert all(r["fused_us"] > 0 and r["pct_of_copy"] > 0 for r in kern["rows"]), kern["rows"]


def test_recorded_signature_of_a_rows_argument_is_its_layout_not_its_identity():
    """Each block hands a rows op a new `SelectedRows` (its own parameters' view, the model's selection function):
    the recording describes it by its fields' layouts, so one step's blocks share a case instead of making one each;
    another layout is another case."""
    from diffusers_fastpath.bench.levels.kernels_recorded import _describe
    from diffusers_fastpath.ops.selected_rows import SelectedRows

    def select(params, mask):
        return params

    def rows(width):
        return SelectedRows(select, torch.randn(3, width), torch.ones(8, dtype=torch.bool))

    assert _describe(rows(16)) == _describe(rows(16)) != _describe(rows(32))
    assert _describe((rows(16), 2.0)) == _describe((rows(16), 2.0))


def test_bench_kernels_level_says_it_needs_cuda(tmp_path):
    """On a CPU the kernels level runs nothing and says why (the fused kernels are CUDA kernels)."""
    path = tmp_path / "z.json"
    assert bench.main(["--model", "z-image-tiny", "--levels", "kernels", "--no-progress", "--height", "64",
                       "--width", "64", "--json", str(path)]) == 0
    kern = json.loads(path.read_text())["kernels"]
    assert kern["ran"] is False and "CUDA" in kern["reason"] and not kern["rows"]


def test_recorded_kernel_cases_are_the_steps_own_calls(emulated_kernels, unpatch_after):
    """A model without hand-written cases (a zoo class) gets its kernel cases from one lossless step: a case per
    signature of the calls whose kernel ran, counted per step, its inputs copies of the recorded ones with their
    strides and offsets (a chunk view stays a view of a storage of its own), eager == fused on every input set
    (kernels emulated here); past the byte budget, calls are counted and not kept."""
    from diffusers_fastpath.bench.levels.kernels_recorded import copy_like, record_step, recorded_cases, recording
    from diffusers_fastpath.bench.subject import Subject
    from diffusers_fastpath.testing import zoo

    model = zoo.build("flux3", dtype=torch.bfloat16)
    inputs = zoo.inputs("flux3", model)
    inputs.pop("return_dict", None)
    subject = Subject("zoo:flux3-tiny", "other", model, inputs)
    with torch.no_grad():
        rec = record_step(subject)
        assert type(model).__name__ == "Flux3Transformer2DModel"  # unpatched after the recorded step
        ops = {name for name, _ in rec.calls}
        assert {"layernorm_modulate", "gated_residual", "silu_mul"} <= ops, ops
        total = sum(entry[2] for entry in rec.calls.values())
        assert total > len(rec.calls) and not rec.dropped  # blocks repeat their signatures
        for case, count in recorded_cases(rec):
            assert count >= 1 and len(case.sets) >= 2 and case.nbytes > 0
            for s in case.sets[:2]:
                assert _same_numbers(case.fused(*s), case.eager(*s)), case.op
                assert _same_numbers(case.checked(*s), case.eager(*s)), case.op
        base = torch.randn(2, 6 * 16, dtype=torch.bfloat16)
        view = base.chunk(6, dim=1)[3]
        copy = copy_like(view)
        assert (copy.stride(), copy.storage_offset(), copy.shape) == (view.stride(), view.storage_offset(), view.shape)
        assert torch.equal(copy, view) and copy.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        fp.patch(model, verify=False)
        unpatch_after(model)
        with recording(budget_bytes=0) as rec:
            model(**inputs)
        assert not rec.calls and sum(rec.dropped.values()) == total, rec.dropped


def _same_numbers(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_numbers(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.gpu
def test_bench_flux_dev_step_generation_profile_on_gpu(tmp_path):
    """FLUX.1-dev config at 256x256: lossless bit-identical at both levels with every site fused, the profile sees
    our kernels only in the patched step, conditions name the GPU."""
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "flux-dev", "--height", "256", "--width", "256", "--steps", "2", "--repeats", "3",
                     "--modes", "eager,lossless", "--profile", "--no-progress", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert result["conditions"]["gpu"] == torch.cuda.get_device_name() and result["conditions"]["driver"]
    step = _rows(result, "step")
    assert step["lossless"]["bit_identical"] is True and step["lossless"]["peak_mem_gib"] > 20
    assert step["lossless"]["fastpath"]["fast"] > 0 and step["lossless"]["fastpath"]["fallback"] == 0
    assert 0 < step["eager"]["host_ms"] and 0 < step["eager"]["ms"]
    gen = _rows(result, "generation")
    assert gen["lossless"]["bit_identical"] is True and gen["lossless"]["image_shape"] == [1, 256, 256, 3]
    prof = {p["mode"]: p for p in result["profile"]["rows"]}
    assert prof["eager"]["unit"] == "CUDA kernels" and prof["eager"]["categories"]["fused"]["count"] == 0
    assert prof["lossless"]["categories"]["fused"]["count"] >= 19 * 4 + 38  # at least one kernel per modulate site
    assert prof["eager"]["categories"]["gemm"]["count"] > 0 and prof["eager"]["categories"]["attention"]["count"] > 0
    assert prof["lossless"]["kernels"] < prof["eager"]["kernels"]
    for p in prof.values():  # idle time is a part of the kernels' span; the listed waits are a part of that
        assert 0 <= p["idle"]["ms"] < p["idle"]["span_ms"]
        assert sum(g["ms"] for g in p["idle"]["by_kernel"]) <= p["idle"]["ms"] + 1e-6


@pytest.mark.gpu
def test_bench_compile_modes_on_gpu_tiny(tmp_path):
    """torch.compile (inductor) and lossless+compile through the pipeline: compile time reported, the transformer
    is uncompiled and unpatched afterwards."""
    path = tmp_path / "r.json"
    rc = bench.main(["--model", "flux-tiny", "--modes", "eager,compile,lossless+compile", "--repeats", "2",
                     "--no-progress", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    for level in ("step", "generation"):
        rows = _rows(result, level)
        assert rows["compile"]["available"] and rows["lossless+compile"]["available"]
        assert rows["compile"]["ratio"] > 0 and rows["lossless+compile"]["ratio"] > 0
        assert rows["compile"]["fastpath"] is None  # the unpatched transformer
        # patched under the compile (with the joint value projections and the fused update + LayerNorm-modulates);
        # the generation patches the pipeline whole, its VAE too
        transformer = next(m for m in rows["lossless+compile"]["fastpath"]["models"]
                           if m["class"] == "FluxTransformer2DModel")
        assert transformer["sites"] == 2 * 8 + 2 * 4 - 1 + 4 * 2 + 2 + 7
        assert rows["eager"]["bit_identical"] is True
    assert all(_rows(result, "step")[n]["compile_s"] > 0 for n in ("compile", "lossless+compile"))
    assert _rows(result, "generation")["compile"]["compile_s"] is None  # compiled once, at the step level


@pytest.mark.gpu
@pytest.mark.parametrize("model, size", [("flux-schnell", ["--height", "512", "--width", "512", "--steps", "2"]),
                                         ("ltx-video-distilled-tiny", ["--height", "256", "--width", "256",
                                                                       "--frames", "17", "--steps", "2"])])
def test_bench_generation_time_split_on_gpu(model, size, tmp_path):
    """The split on the GPU (CUDA events of the timed call): every part measured, their sum within the end-to-end
    time, the patched modes md5-identical to eager, the pipeline's VAE patched with every site fast where it is."""
    path = tmp_path / "r.json"
    rc = bench.main(["--model", model, *size, "--levels", "generation", "--gen-repeats", "2",
                     "--modes", "eager,lossless,lossless+graphs", "--no-progress", "--json", str(path)])
    assert rc == 0
    rows = _rows(json.loads(path.read_text()), "generation")
    for name in ("eager", "lossless", "lossless+graphs"):
        split = rows[name]["split"]
        assert split["clock"] == "CUDA events" and split["text_encoded"] is False
        assert split["denoise_ms"] > 0 and split["decode_ms"] > 0 and split["text_ms"] >= 0
        assert split["text_ms"] + split["denoise_ms"] + split["decode_ms"] <= split["total_ms"]
        for call in rows[name]["split_all"]:
            assert call["text"] + call["denoise"] + call["decode"] <= call["total"]
        assert rows[name]["latents_md5"] == rows["eager"]["latents_md5"]
        assert rows[name]["image_md5"] == rows["eager"]["image_md5"]
    for name in ("lossless", "lossless+graphs"):
        models = {m["name"]: m for m in rows[name]["fastpath"]["models"]}
        assert models["transformer"]["fast"] > 0
        if "vae" in models:  # FLUX.1's AutoencoderKL; LTX-Video's VAE once an adapter takes it
            assert models["vae"]["fast"] > 0 and models["vae"]["fallback"] == 0, models["vae"]
    assert rows["lossless+graphs"]["fastpath"]["graphs"]["replays"] > 0


def test_idle_gaps_are_the_uncovered_time_between_kernels():
    from types import SimpleNamespace as NS

    def kernel(name, start, end):
        return NS(name=name, time_range=NS(start=start, end=end))

    # a (0-10), b overlaps a (5-12), gap of 8 before c (20-30), gap of 2 before d (32-40), gap of 10 before c again
    kernels = [kernel("c", 20, 30), kernel("a", 0, 10), kernel("b", 5, 12), kernel("d", 32, 40), kernel("c", 50, 51)]
    idle = idle_gaps(kernels)
    assert idle["span_ms"] == pytest.approx(0.051) and idle["ms"] == pytest.approx(0.020)
    assert idle["gaps"] == 2  # the 2 µs gap is under IDLE_GAP_US
    assert idle["by_kernel"] == [dict(kernel="c", count=2, ms=pytest.approx(0.018))]
    assert idle_gaps([]) == dict(span_ms=0.0, ms=0.0, gaps=0, by_kernel=[])


def test_zoo_models_published_as_their_class_defaults_are_benched_at_full_size():
    """A zoo entry whose published config is its class's defaults (``full_config={}``, FLUX.3's, Sana's) is a full-size
    bench model (it was taken for "unknown", as ``None`` is: `.ci/gpu`'s ``zoo:flux3`` was refused)."""
    from diffusers_fastpath.bench.subject import ZOO_MODELS
    from diffusers_fastpath.testing import zoo

    for name, entry in zoo.ZOO.items():
        assert (f"zoo:{name}" in ZOO_MODELS) == (entry.full_config is not None), name
        assert f"zoo:{name}-tiny" in ZOO_MODELS
    assert {"zoo:flux3", "zoo:sana", "zoo:wan-vace", "zoo:qwen-image-21"} <= set(ZOO_MODELS)


def test_a_zoo_models_report_names_the_inputs_it_ran(tmp_path):
    """A zoo model runs at its entry's size (``--height`` and the others do not reach it): the report's first line
    says that size, not the FLUX defaults (Wan VACE's full-size run was headed "1024x1024, 28 steps")."""
    import argparse

    from diffusers_fastpath.bench.conditions import conditions
    from diffusers_fastpath.bench.render import describe_conditions

    args = argparse.Namespace(model="zoo:wan-vace", dtype="bf16", height=1024, width=1024, steps=28, batch=1,
                              text_tokens=512, quant="none")
    line = describe_conditions(conditions(args, torch.device("cpu")))
    assert "inputs frames=81, height=480, width=832, text=512" in line and "1024x1024" not in line
    args.model = "flux-dev"
    assert "1024x1024, 28 steps, 512 text tokens" in describe_conditions(conditions(args, torch.device("cpu")))


def test_zoo_size_knobs_reach_the_inputs_and_the_report(tmp_path):
    """``--zoo-size KNOB=INT`` goes to the zoo entry's inputs (Qwen-Image 2.1's KV-cached later step: the prefill
    runs in the builder, the step's kwargs name the "cached" mode) and to the report's first line; another form is
    a clear error."""
    import argparse

    from diffusers_fastpath.bench.conditions import conditions
    from diffusers_fastpath.bench.render import describe_conditions
    from diffusers_fastpath.bench.subject import build_subject, zoo_knobs

    assert zoo_knobs(["cached=1", "text=16"]) == {"cached": 1, "text": 16}
    for bad in ("cached", "cached=yes", "=1", "two words=1"):
        with pytest.raises(SystemExit, match="KNOB=INT"):
            zoo_knobs([bad])
    args = argparse.Namespace(model="zoo:qwen-image-21", dtype="bf16", height=1024, width=1024, steps=28, batch=1,
                              text_tokens=512, quant="none", zoo_size=["cached=1"])
    assert "inputs height=1024, width=1024, text=256, cached=1" in describe_conditions(
        conditions(args, torch.device("cpu")))
    args = argparse.Namespace(model="zoo:qwen-image-21-tiny", dtype="bf16", height=1024, width=1024, batch=1, seed=0,
                              quant="none", zoo_size=["cached=1"])
    subject = build_subject(args, torch.device("cpu"), need_vae=False)
    assert subject.step_inputs["kv_cache_mode"] == "cached" and subject.step_inputs["kv_cache"].get_layer(0).k is not None
