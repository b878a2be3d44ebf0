"""What a new user meets in the first ten minutes (issue 44): one error type for what `patch` cannot take (and a word
for UNets), a warning where fp32 weights make the patch a no-op, `quality` called without ``with``, the report's
first line where no kernel can run, ``report(verbose=True)`` as documented, a documented `supported_classes`, the
CPU benchmark saying that nothing ran fused, and the tiny pipelines built without transformers' torchvision notice.
"""

from __future__ import annotations

import doctest
import logging

import pytest
import torch
from diffusers import DiffusionPipeline, UNet2DConditionModel

import diffusers_fastpath as fp
from diffusers_fastpath import _logging, bench, patching
from diffusers_fastpath.bench.render import markdown
from diffusers_fastpath.ops import _build
from diffusers_fastpath.quality import NOT_IN_WITH
from diffusers_fastpath.report import kernels_line
from diffusers_fastpath.testing import build_flux_transformer, build_wan_transformer, tiny_flux_pipeline
from diffusers_fastpath.testing._common import _quiet_image_processor_fallback


class _VaeOnly(DiffusionPipeline):
    def __init__(self, vae):
        super().__init__()
        self.register_modules(vae=vae)


class _UNetPipeline(DiffusionPipeline):
    """What a Stable Diffusion 1.x / SDXL pipeline looks like to `patch`: a UNet, no transformer."""

    def __init__(self, unet):
        super().__init__()
        self.register_modules(unet=unet)


class _TransformerOnly(DiffusionPipeline):
    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)


def _tiny_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
                                layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=8,
                                norm_num_groups=4, attention_head_dim=2)


# --- one error type ------------------------------------------------------------------------------------------------


def test_an_unsupported_model_and_a_pipeline_without_one_raise_the_same_error():
    """Both used to differ (TypeError, ValueError); the one error derives from both, so either old except still
    catches it."""
    with pytest.raises(fp.UnsupportedModelError, match="does not support Linear.*Supported: .*FluxTransformer2DModel"):
        fp.patch(torch.nn.Linear(2, 2))
    with pytest.raises(fp.UnsupportedModelError, match=r"holds no supported model \(vae=Linear\)"):
        fp.patch(_VaeOnly(vae=torch.nn.Linear(2, 2)))  # (FLUX's AutoencoderKL is patched: models/vae_kl.py)
    assert issubclass(fp.UnsupportedModelError, TypeError) and issubclass(fp.UnsupportedModelError, ValueError)
    with pytest.raises(ValueError):  # code written for the pipeline case
        fp.patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError):  # code written for the model case
        fp.patch(_VaeOnly(vae=torch.nn.Linear(2, 2)))


def test_a_unet_is_told_that_unets_are_not_what_this_package_patches():
    unet = _tiny_unet()
    with pytest.raises(fp.UnsupportedModelError, match=r"UNets \(unet=UNet2DConditionModel\) are not what this package "
                                                       r"patches: it fuses the chains of diffusion transformers"):
        fp.patch(_UNetPipeline(unet=unet))
    with pytest.raises(fp.UnsupportedModelError, match="UNets .* are not what this package patches"):
        fp.patch(unet)
    assert "UNet" not in str(pytest.raises(fp.UnsupportedModelError, fp.patch, torch.nn.Linear(2, 2)).value)


# --- fp32 weights --------------------------------------------------------------------------------------------------


def _messages(log, level):
    return [r.getMessage() for r in log.records if r.levelno == level and "weights; the fused kernels" in r.getMessage()]


def test_patching_an_fp32_model_says_it_runs_eager(fastpath_log, monkeypatch, unpatch_after):
    """On a CUDA device fp32 weights make every site fall back: one warning says so at patch time (not only the
    report), once per process; on a CPU, where nothing runs fused anyway, an info line."""
    monkeypatch.setattr(_logging, "_warned", set())
    model = build_flux_transformer("flux-tiny", torch.float32, seed=1)
    fp.patch(model)
    unpatch_after(model)
    info = _messages(fastpath_log, logging.INFO)
    assert info == ["diffusers_fastpath: FluxTransformer2DModel (FluxTransformer2DModel) has float32 weights; the fused "
                    "kernels take bfloat16 and float16 only, so every fused site runs diffusers' eager expression (the "
                    "same numbers, no speed-up). Load it with torch_dtype=torch.bfloat16 (or float16) for the fast path."]
    assert not _messages(fastpath_log, logging.WARNING)

    monkeypatch.setattr(patching, "_on_cuda", lambda m: True)  # where the kernels could have run
    for seed in (2, 3):
        other = build_flux_transformer("flux-tiny", torch.float32, seed=seed)
        fp.patch(_TransformerOnly(transformer=other))
        unpatch_after(other)
    warnings = _messages(fastpath_log, logging.WARNING)
    assert len(warnings) == 1 and warnings[0].startswith("diffusers_fastpath: transformer (FluxTransformer2DModel) has "
                                                         "float32 weights")


@pytest.mark.parametrize("build", [lambda: build_flux_transformer("flux-tiny", torch.bfloat16, seed=4),
                                   lambda: build_wan_transformer("wan-tiny", torch.bfloat16, seed=4)],
                         ids=["bf16", "bf16_with_fp32_norms"])
def test_half_precision_models_are_not_warned_about(build, fastpath_log, monkeypatch, unpatch_after):
    monkeypatch.setattr(_logging, "_warned", set())
    monkeypatch.setattr(patching, "_on_cuda", lambda m: True)
    model = build()
    fp.patch(model)
    unpatch_after(model)
    assert not _messages(fastpath_log, logging.WARNING) and not _messages(fastpath_log, logging.INFO)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_fp32_model_on_the_gpu_warns_at_patch_time(fastpath_log, monkeypatch, unpatch_after):
    monkeypatch.setattr(_logging, "_warned", set())
    model = build_flux_transformer("flux-tiny", torch.float32, "cuda", seed=5)
    fp.patch(model)
    unpatch_after(model)
    assert len(_messages(fastpath_log, logging.WARNING)) == 1


# --- quality without `with` ----------------------------------------------------------------------------------------


def test_quality_called_without_with_changes_nothing_and_says_so(fastpath_log, monkeypatch, unpatch_after):
    monkeypatch.setattr(_logging, "_warned", set())
    model = build_flux_transformer("flux-tiny", seed=6)
    fp.patch(model)
    unpatch_after(model)
    fp.quality(model, "high")  # a plain statement: made and dropped
    assert fp.report(model).models[0].quality == "lossless"
    warnings = [r.getMessage() for r in fastpath_log.records if r.levelno == logging.WARNING]
    assert warnings == [NOT_IN_WITH] and "fp.patch(pipe, quality=\"high\")" in NOT_IN_WITH
    request = fp.quality(model, "high")
    assert "not entered" in repr(request)
    with request as same:  # made first, entered later: no warning, and it applies
        assert same is model and fp.report(model).models[0].quality == "high"
    del request
    assert fp.report(model).models[0].quality == "lossless"
    assert [r.getMessage() for r in fastpath_log.records if r.levelno == logging.WARNING] == [NOT_IN_WITH]
    fp.patch(model, quality="high")  # what the warning recommends: the tier from now on
    assert fp.report(model).models[0].quality == "high"


def test_quality_checks_its_arguments_when_called():
    with pytest.raises(ValueError, match="not patched"):
        fp.quality(build_flux_transformer("flux-tiny", seed=7), "high")  # no `with` needed to find out


# --- report --------------------------------------------------------------------------------------------------------


def test_the_reports_first_line_says_no_kernels_run_on_a_machine_without_cuda(monkeypatch, unpatch_after):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_build, "load_seconds", None)
    monkeypatch.setattr(_build, "unavailable", None)
    model = build_flux_transformer("flux-tiny", seed=8)
    fp.patch(model)
    unpatch_after(model)
    first = str(fp.report(model)).splitlines()[0]
    assert first.startswith("diffusers_fastpath: no CUDA kernels run here (")
    assert first.endswith("every fused site runs diffusers' eager expression, the same numbers with no speed-up")
    # the same once something has asked the loader (it failed: no CUDA), as any CPU process's later tests do
    monkeypatch.setattr(_build, "unavailable", "this build of torch has no CUDA. (simulated)")
    assert str(fp.report(model)).splitlines()[0] == first
    monkeypatch.setattr(_build, "unavailable", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine before the first fused call
    assert kernels_line() == _build.kernels_status() and "not loaded" in kernels_line()


def test_report_returns_and_prints_nothing_verbose_or_not(capsys, unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=9)
    fp.patch(model)
    unpatch_after(model)
    short, full = fp.report(model), fp.report(model, verbose=True)
    assert capsys.readouterr().out == ""
    assert str(short).splitlines()[-1] == "(print(fp.report(obj, verbose=True)) lists every site)"
    def site_table(rep):
        return [line for line in str(rep).splitlines() if line.startswith("| site ")]

    assert site_table(full) and not site_table(short) and full.to_dict()["sites"] == short.to_dict()["sites"]
    assert "prints nothing itself" in fp.report.__doc__


def test_supported_classes_is_documented_and_its_example_runs():
    doc = fp.supported_classes.__doc__
    assert doc and "patch" in doc
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(fp.supported_classes, globs={}):
        runner.run(test)
    assert runner.tries >= 2 and runner.failures == 0


# --- the benchmark on a CPU ----------------------------------------------------------------------------------------


def test_the_cpu_benchmark_says_nothing_ran_fused_beside_its_ratios(capsys, tmp_path):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = bench.main(["--model", "flux-tiny", "--device", "cpu", "--height", "32", "--width", "32", "--steps", "1",
                         "--text-tokens", "8", "--repeats", "1", "--levels", "step", "--modes", "lossless",
                         "--no-progress", "--json", str(tmp_path / "run.json")])
    finally:
        torch.set_num_threads(old)
    out = capsys.readouterr().out
    assert rc == 0
    note = out.index("**No fused kernel ran** (this run was on a CPU, and the kernels are CUDA-only)")
    assert note < out.index("| lossless |")  # said before the first ratio
    import json

    result = json.loads((tmp_path / "run.json").read_text())
    assert [r["fastpath"]["kernel_calls"] for r in result["step"]["rows"] if r["fastpath"]] == [0]
    for row in result["step"]["rows"]:  # the same run, had a kernel run: no note
        if row["fastpath"]:
            row["fastpath"]["kernel_calls"] = 3
    assert "No fused kernel ran" not in markdown(result)
    for row in result["step"]["rows"]:  # a run saved before kernel_calls was recorded: judged by its device
        if row["fastpath"]:
            del row["fastpath"]["kernel_calls"]
    assert "No fused kernel ran" in markdown(result)
    result["conditions"]["gpu"] = "NVIDIA H200"
    assert "No fused kernel ran" not in markdown(result)


# --- transformers' torchvision notice ------------------------------------------------------------------------------


def test_the_tiny_pipelines_drop_only_transformers_torchvision_notice():
    """Building a pipeline imports diffusers' pipeline module, whose ``from transformers import CLIPImageProcessor``
    makes transformers log a PIL-fallback notice without torchvision (two lines before every example's output).
    While the builders import, exactly that message of that logger is dropped; other messages pass, and the filter
    is gone afterwards."""
    source = logging.getLogger("transformers.utils.import_utils")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    source.addHandler(handler)
    old_level = source.level
    source.setLevel(logging.INFO)
    try:
        with _quiet_image_processor_fallback():
            source.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                           "`CLIPImageProcessorPil` for backward compatibility.")
            source.warning("something else")
        source.warning("`X` requires torchvision (not installed); falling back to `XPil`")
    finally:
        source.removeHandler(handler)
        source.setLevel(old_level)
    assert seen == ["something else", "`X` requires torchvision (not installed); falling back to `XPil`"]
    assert not source.filters
