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

from diffusers_fastpath import bench
from diffusers_fastpath.bench.cli import _check_args, _parser
from diffusers_fastpath.bench.levels.profile import idle_gaps

TINY = ["--model", "flux-tiny", "--device", "cpu", "--height", "64", "--width", "64", "--steps", "2",
        "--text-tokens", "8", "--no-progress"]
STEP_FIELDS = {"mode", "available", "reason", "ms", "host_ms", "ms_all", "host_ms_all", "ratio", "peak_mem_gib",
               "compile_s", "md5", "bit_identical", "max_abs_diff", "psnr_db", "repeatable", "interleaved", "fastpath", "sensors"}
GEN_FIELDS = {"mode", "available", "reason", "s", "s_all", "host_s", "ratio", "peak_mem_gib", "compile_s", "warmup_s",
              "latents_md5", "image_md5", "image_shape", "bit_identical", "latents_identical", "image_identical",
              "max_abs_diff_latents", "psnr_db", "ssim", "repeatable", "interleaved", "fastpath"}
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
        assert md.count(f"| {name} |") == 3, name  # step, generation and profile tables
    assert md.count("| missing |") == 2  # unavailable: in the timing tables, with its reason
    c = tiny_run["result"]["conditions"]
    assert f"torch {c['torch']}" in md and f"commit `{c['commit']}`" in md and "64x64" in md
    assert "Kernels level: needs CUDA" in md


def test_profile_table_says_what_fusion_removed_outside_gemms_and_attention(tiny_run):
    """Each profiled mode's time outside GEMMs and attention, and the share of eager's that it no longer spends (the
    families' goal metric), computed from the row's own categories."""
    from diffusers_fastpath.bench.render import rest_ms

    rows = {p["mode"]: p for p in tiny_run["result"]["profile"]["rows"]}
    eager, lossless = rest_ms(rows["eager"]), rest_ms(rows["lossless"])
    c = rows["lossless"]["categories"]
    assert lossless == pytest.approx(sum(c[n]["ms"] for n in bench.CATEGORY_NAMES if n not in ("gemm", "attention")))
    line = next(l for l in tiny_run["markdown"].splitlines() if l.startswith("| lossless |") and f"{lossless:.2f} (" in l)
    assert line.endswith(f"{lossless:.2f} ({1 - lossless / eager:.0%}) |")
    assert "outside GEMMs and attention: ms (removed)" in tiny_run["markdown"]


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


@pytest.mark.parametrize("model", ["sd3-tiny", "qwen-image-tiny", "hunyuan-image-tiny", "wan-tiny",
                                   "z-image-tiny", "lumina2-tiny", "hunyuanvideo-1.5-tiny", "ltx-video-tiny"])
def test_step_only_families_on_cpu(model, tmp_path):
    path = tmp_path / "r.json"
    rc = bench.main(["--model", model, "--device", "cpu", "--height", "64", "--width", "64", "--text-tokens", "8",
                     "--repeats", "1", "--modes", "lossless", "--no-progress", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert _rows(result, "step")["lossless"]["bit_identical"] is True and _rows(result, "step")["lossless"]["fastpath"]["sites"] > 0
    assert result["generation"]["ran"] is False and model in result["generation"]["reason"]


@pytest.mark.parametrize("model, tokens", [("lumina2", 256), ("lumina2-tiny", 32), ("flux-dev", 512),
                                           ("ernie-image", 120), ("z-image", 512)])
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
                "linear_cat"}
    sd3_ops = {"layernorm_scale_shift", "gated_residual", "rmsnorm (image q)", "rmsnorm (text q)", "cat_heads"}
    qwen_ops = {"layernorm_scale_shift", "gated_residual", "rmsnorm_rope_complex (image q)",
                "rmsnorm_rope_complex (text q)", "rmsnorm_rope_complex_cat (text+image q)"}
    for model, ops in (("flux-dev", flux_ops), ("ernie-image", {"rmsnorm_scale_shift", "gated_rmsnorm_scale_shift"}),
                       ("sd3-tiny", sd3_ops),  # SD3's head_dim 64 at 1024x1024's 4096 image tokens
                       ("qwen-image-tiny", qwen_ops), ("ltx-video-tiny", {"rmsnorm_modulate", "rotary_emb_rows (q)", "qk_norm_rows_rope (q)",
                                          "qk_norm_rows_rope_pair (q, k)"}),
                       ("flux2-klein", {"layernorm_scale_shift", "gated_residual", "qk_norm_rope (text+image)",
                                        "qk_norm_rope", "silu_mul"})):
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


def test_bench_kernels_level_names_the_families_it_covers(tmp_path):
    """A model without kernel cases at its shapes says so (and the profile level is what times its kernels)."""
    path = tmp_path / "z.json"
    assert bench.main(["--model", "z-image-tiny", "--levels", "kernels", "--no-progress", "--height", "64",
                       "--width", "64", "--json", str(path)]) == 0
    kern = json.loads(path.read_text())["kernels"]
    assert kern["ran"] is False and "SD3 and SD3.5" in kern["reason"] and not kern["rows"]


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
        # patched under the compile (with the joint value projections and the fused update + LayerNorm-modulates)
        assert rows["lossless+compile"]["fastpath"]["sites"] == 2 * 8 + 2 * 4 - 1 + 4 * 2 + 2 + 7
        assert rows["eager"]["bit_identical"] is True
    assert all(_rows(result, "step")[n]["compile_s"] > 0 for n in ("compile", "lossless+compile"))
    assert _rows(result, "generation")["compile"]["compile_s"] is None  # compiled once, at the step level


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
