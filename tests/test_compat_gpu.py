"""The compatibility cells that need CUDA (README, "Works with"): training one backward per process, offloading to
the accelerator, group offload with streams, every CUDA attention backend, and CUDA graphs under each cell.
Every cell is `torch.equal` to unpatched diffusers under the same setup; the CPU cells are in `tests/test_compat.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs, prompt_embeddings, tiny_flux_pipeline

pytestmark = pytest.mark.gpu

TRAIN_ONCE = Path(__file__).with_name("train_once.py")


def out(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def _train(tmp_path, *flags) -> tuple[dict | None, str]:
    """One backward in a fresh process (see train_once.py): (saved tensors, or None where the process failed; the
    end of its stderr)."""
    path = tmp_path / ("_".join(f.strip("-").replace("=", "-") for f in flags) or "plain")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TRAIN_ONCE.parent.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(TRAIN_ONCE), f"{path}.pt", *flags], env=env, capture_output=True,
                         text=True, timeout=600)
    return (torch.load(f"{path}.pt") if run.returncode == 0 else None), run.stderr[-4000:]


def _fault(stderr: str) -> str:
    return next((line for line in reversed(stderr.splitlines()) if "Error" in line), stderr[-300:])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("backend", [None, "_native_flash", "_native_math"], ids=["default_backend", "flash", "math"])
def test_training_one_backward_per_process(tmp_path, checkpointing, backend):
    """Outputs, the latents' gradient and every parameter's gradient of a patched training step are `torch.equal`
    to the unpatched step of the same setup, each in its own process, with deterministic algorithms on.

    Measured on the H200 (issue 12): without them two *unpatched* runs with the flash backend differ in 119 of 140
    parameter gradients (its backward accumulates dq with atomics), so no comparison could hold; with them unpatched,
    unpatched and patched are bitwise equal. Where the unpatched step itself faults (the default backend on the H200
    image: CUBLAS_STATUS_EXECUTION_FAILED in a bf16 GEMM of the backward), there is nothing to compare with: the test
    is an expected failure that says so and whether the patched step ran; a patched fault where unpatched ran fails.
    """
    flags = ["--deterministic"] + (["--checkpointing"] if checkpointing else []) + (
        [f"--backend={backend}"] if backend else [])
    ref, ref_err = _train(tmp_path, *flags)
    got, got_err = _train(tmp_path, "--patched", *flags)
    if ref is None:
        pytest.xfail(f"unpatched diffusers faults here too ({_fault(ref_err)}); patched: "
                     f"{'ran' if got is not None else _fault(got_err)}")
    assert got is not None, f"the patched step faulted where the unpatched one ran:\n{got_err}"
    assert torch.equal(got["out"], ref["out"]) and torch.equal(got["latents"], ref["latents"])
    assert got["grads"].keys() == ref["grads"].keys()
    assert all((g is None) == (got["grads"][n] is None) and (g is None or torch.equal(got["grads"][n], g))
               for n, g in ref["grads"].items())


def assert_graphs_replay_or_say_why(graphs: dict, calls: int) -> None:
    """After `calls` forwards: replayed from the second on, or eager with the reason counted per call, or off from
    the start with the reason in the status (a hook that wraps the forward per instance)."""
    replayed = graphs["replays"] == calls - 1
    eager_counted = graphs["replays"] == 0 and sum(graphs["eager"].values()) >= calls - 1
    off_said = graphs["replays"] == graphs["captures"] == 0 and graphs["status"].startswith("off: ")
    assert replayed or eager_counted or off_said, graphs


def _generate(pipe, emb):
    pipe.set_progress_bar_config(disable=True)
    return pipe(**emb, height=64, width=64, num_inference_steps=3, output_type="latent",
                generator=torch.Generator("cpu").manual_seed(5)).images.cpu()


@pytest.mark.parametrize("feature", ["model_cpu_offload", "sequential_cpu_offload"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_pipeline_offloading(feature, cuda_graphs, unpatch_after):
    ref_pipe, pipe = tiny_flux_pipeline(seed=1), tiny_flux_pipeline(seed=1)
    emb = prompt_embeddings(pipe, seed=2, device="cuda")  # the execution device: the pipeline moves none of them
    for p in (ref_pipe, pipe):
        getattr(p, f"enable_{feature}")()
    ref = _generate(ref_pipe, emb)
    fp.patch(pipe, cuda_graphs=cuda_graphs)
    unpatch_after(pipe)
    assert torch.equal(_generate(pipe, emb), ref)
    if cuda_graphs:  # offloading hooks move weights per call: graphs run eager and say why
        assert_graphs_replay_or_say_why(fp.report(pipe.transformer).models[0].graphs, calls=3)  # (the VAE: patched too)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("use_stream", [False, True], ids=["sync", "stream"])
def test_group_offload_to_the_gpu(offload_type, use_stream, unpatch_after):
    ref_model = build_flux_transformer("flux-tiny", seed=3)
    model = build_flux_transformer("flux-tiny", seed=3)
    inputs = flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=4, device="cuda")
    kwargs = dict(onload_device=torch.device("cuda"), offload_device=torch.device("cpu"), offload_type=offload_type,
                  use_stream=use_stream)
    if offload_type == "block_level":
        kwargs["num_blocks_per_group"] = 1
    for m in (ref_model, model):
        m.enable_group_offload(**kwargs)
    fp.patch(model)
    unpatch_after(model)
    for _ in range(2):
        assert torch.equal(out(model, inputs), out(ref_model, inputs))


def _backends():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    names = ["native", "_native_math", "_native_cudnn", "_native_flash", "_native_efficient", "flash", "sage"]
    known = {b.value for b in AttentionBackendName}
    return [n for n in names if n in known]


@pytest.mark.parametrize("backend", _backends())
def test_every_attention_backend(backend, unpatch_after):
    ref_model = build_flux_transformer("flux-tiny", device="cuda", seed=5)
    model = build_flux_transformer("flux-tiny", device="cuda", seed=5)
    inputs = flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=6)
    try:
        ref_model.set_attention_backend(backend)
        ref = out(ref_model, inputs)
    except (RuntimeError, ImportError, ValueError) as exc:  # not installed / not supported on this machine
        pytest.skip(f"attention backend {backend} unavailable here: {exc}")
    model.set_attention_backend(backend)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(out(model, inputs), ref)
    rep = fp.report(model)
    assert rep.fast > 0 and all(s.fallback == 0 for s in rep.sites if s.op != "rotary_emb"), str(rep)


def test_inference_mode_and_autocast_on_the_gpu(unpatch_after):
    ref_model = build_flux_transformer("flux-tiny", device="cuda", seed=7)
    model = build_flux_transformer("flux-tiny", device="cuda", seed=7)
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    with torch.inference_mode():
        inputs = flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=8)
        for _ in range(3):
            assert torch.equal(model(**inputs).sample, ref_model(**inputs).sample)
    assert fp.report(model).models[0].graphs["replays"] >= 1


@torch.no_grad()
def test_a_bf16_transformer_and_vae_under_cuda_autocast(unpatch_after):
    """CUDA autocast runs layer_norm, group_norm, rsqrt, pow, ... in float32 for bf16 inputs: eager's chains there
    are not the kernels'; every fused op refuses under autocast (`_policy.autocast_on`), so patched == unpatched."""
    from diffusers_fastpath.testing import build_flux_vae

    ref_model = build_flux_transformer("flux-tiny", device="cuda", seed=7)
    model = build_flux_transformer("flux-tiny", device="cuda", seed=7)
    ref_vae = build_flux_vae("flux-tiny", device="cuda", seed=3).eval()
    vae = build_flux_vae("flux-tiny", device="cuda", seed=3).eval()
    unpatch_after(fp.patch(model))
    unpatch_after(fp.patch(vae))
    inputs = flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=8, device="cuda")
    z = torch.randn(1, vae.config.latent_channels, 16, 16, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pairs = [(model(**inputs).sample, ref_model(**inputs).sample), (vae.decode(z).sample, ref_vae.decode(z).sample)]
    for got, ref in pairs:
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    assert torch.equal(model(**inputs).sample, ref_model(**inputs).sample) and fp.report(model).fast > 0


def _lora(m):
    from peft import LoraConfig

    torch.manual_seed(0)
    m.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "proj_mlp"],
                             init_lora_weights=False), adapter_name="a")


def _group_offload(m):
    m.enable_group_offload(onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1)


SETUPS = {
    "plain": lambda m: None,
    "lora": _lora,
    "fuse_qkv": lambda m: m.fuse_qkv_projections(),
    "math_attention": lambda m: m.set_attention_backend("_native_math"),
    "group_offload": _group_offload,
    "layerwise_fp8": lambda m: m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("setup", SETUPS)
def test_cuda_graphs_under_each_cell_replay_or_say_why(setup, unpatch_after):
    """With ``cuda_graphs=True`` each cell is still `torch.equal` to unpatched eager, and either replays or runs
    eager with its reason in the report (never silently)."""
    if setup == "lora":
        pytest.importorskip("peft")
    ref_model = build_flux_transformer("flux-tiny", device="cuda", seed=9)
    model = build_flux_transformer("flux-tiny", device="cuda", seed=9)
    inputs = flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=10, device="cuda")  # bf16, before
    for m in (ref_model, model):                                                                 # fp8 storage
        SETUPS[setup](m)
    ref = out(ref_model, inputs)
    fp.patch(model, cuda_graphs=True)
    unpatch_after(model)
    for _ in range(3):
        assert torch.equal(out(model, inputs), ref)
    assert_graphs_replay_or_say_why(fp.report(model).models[0].graphs, calls=3)
