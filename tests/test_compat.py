"""The compatibility contract on CPU: the ordinary ways of running diffusers, each `torch.equal` to unpatched
diffusers under the same setup (README, "Works with", names each cell's test).

Every cell builds two models from the same seed (`twins`), applies the same setup to both, patches one, and compares
outputs (and, for training, every gradient) bit for bit. On a CPU the fused kernels never run, so these cells check
the patched Python path: the mirrored forwards, the processors, the fallbacks, what the patch adds to a model.
The cells that need CUDA (offloading to an accelerator, streams, CUDA attention backends) are in
`tests/test_compat_gpu.py`.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
from diffusers import FluxTransformer2DModel

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.ops import OPS, _build
from diffusers_fastpath.ops._policy import ENV_DISABLE, REASON_AUTOCAST, REASON_ENV, REASON_NO_KERNELS
from diffusers_fastpath.testing import zoo
from diffusers_fastpath.testing import (
    build_ernie_image_transformer,
    build_flux2_transformer,
    build_flux2_vae,
    build_flux_transformer,
    build_hunyuan_video15_transformer,
    build_lumina2_transformer,
    build_qwenimage_transformer,
    build_sd3_transformer,
    build_zimage_transformer,
    ernie_image_inputs,
    flux2_prompt_embeddings,
    flux_transformer_inputs,
    hunyuan_video15_transformer_inputs,
    lumina2_transformer_inputs,
    prompt_embeddings,
    qwenimage_pipeline,
    qwenimage_prompt_embeddings,
    qwenimage_transformer_inputs,
    sd3_transformer_inputs,
    tiny_flux_pipeline,
    zimage_transformer_inputs,
)

# family -> (build, make_inputs, the input the training cell differentiates through)
FAMILIES = {
    "flux": (lambda dtype, seed: build_flux_transformer("flux-tiny", dtype, seed=seed), flux_transformer_inputs,
             "hidden_states"),
    "ernie": (lambda dtype, seed: build_ernie_image_transformer(dtype=dtype, seed=seed), ernie_image_inputs,
              "hidden_states"),
    # the sandwich-norm families (their rewritten blocks, the RMSNorm + scale / gated residual sites), narrower and
    # shallower than their tiny configs: on a CPU every site takes its fallback at any width
    "zimage": (lambda dtype, seed: build_zimage_transformer(dtype=dtype, seed=seed, dim=256, n_heads=2, n_kv_heads=2,
                                                            n_layers=1), zimage_transformer_inputs, "x"),
    "lumina2": (lambda dtype, seed: build_lumina2_transformer(dtype=dtype, seed=seed, hidden_size=256,
                                                              num_attention_heads=2, num_kv_heads=1, num_layers=1,
                                                              axes_dim_rope=(32, 48, 48)),
                lumina2_transformer_inputs, "hidden_states"),
    # the QK norm + rotary families (their rewritten processors: the complex form, the real form), one block each
    "qwenimage": (lambda dtype, seed: build_qwenimage_transformer(dtype=dtype, seed=seed, num_layers=1),
                  qwenimage_transformer_inputs, "hidden_states"),
    "hunyuanvideo15": (lambda dtype, seed: build_hunyuan_video15_transformer(dtype=dtype, seed=seed, num_layers=1),
                       hunyuan_video15_transformer_inputs, "hidden_states"),
    # the swapped QK norm modules (FastpathRMSNorm) and SD3's rewritten blocks, a dual-attention block among them
    "sd3": (lambda dtype, seed: build_sd3_transformer(dtype=dtype, seed=seed, num_layers=2),
            sd3_transformer_inputs, "hidden_states"),
    # the generic path (no family adapter; verified on the first forward of each input signature): Wan VACE (Wan's
    # blocks, its stream taken in memory order), HunyuanVideo Framepack (HunyuanVideo's blocks), and the 2026 forms:
    # FLUX.3 (per-token LayerNorm rows, fp32 QK norms), Qwen-Image 2.1 (its modulate method, QK norms inlined from a
    # helper; group offloading after `patch` once crashed its reference run), LTX-2 (video + audio, rows rotary)
    **{name: (lambda dtype, seed, name=name: zoo.build(name, dtype=dtype, seed=seed),
              lambda model, seed, name=name, **kwargs: {k: v for k, v in zoo.inputs(name, model, seed=seed, **kwargs).items()
                                                       if k != "return_dict"}, "hidden_states")
       for name in ("wan-vace", "hunyuan-framepack", "flux3", "qwen-image-21", "ltx2")},
}


def _tensors(x, fn):
    """`fn` applied to a tensor, or to each tensor of a list (Z-Image takes and returns one latent per sample)."""
    return [fn(t) for t in x] if isinstance(x, list) else fn(x)


def twins(family: str, dtype=torch.bfloat16, seed=0):
    """Two identical models (the reference stays unpatched) and fresh random inputs for them."""
    build, make_inputs, _ = FAMILIES[family]
    ref, model = build(dtype, seed), build(dtype, seed)
    return ref, model, make_inputs(model, seed=seed + 100)


def out(model, inputs, **kwargs):
    with torch.no_grad():
        sample = model(**inputs, **kwargs).sample
    return torch.stack(sample) if isinstance(sample, list) else sample


def _batch_inputs(family, model, seed, **kwargs):
    return FAMILIES[family][1](model, seed=seed, **kwargs)


# --- execution modes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("inputs_made", ["outside", "inside"])
def test_inference_mode(family, inputs_made, unpatch_after):
    """Inference tensors have no version counter: nothing in the patched path may read one."""
    ref_model, model, inputs = twins(family, seed=1)
    fp.patch(model)
    unpatch_after(model)
    for _ in range(2):  # two denoising steps
        with torch.inference_mode():
            if inputs_made == "inside":
                inputs = _batch_inputs(family, model, seed=7)
            got, ref = model(**inputs).sample, ref_model(**inputs).sample
            got, ref = (torch.stack(t) if isinstance(t, list) else t for t in (got, ref))
        assert torch.equal(got, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_autocast_of_an_fp32_model(family, unpatch_after):
    """Under autocast the residual stream and the modulated norms have different dtypes: every fallback must cast
    where diffusers casts (ERNIE-Image's gated residual goes to the modulate output's dtype, not the residual's)."""
    ref_model, model, inputs = twins(family, torch.float32, seed=2)
    fp.patch(model)
    unpatch_after(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = out(ref_model, inputs), out(model, inputs)
    assert ref.dtype == got.dtype and torch.equal(got, ref)


@pytest.mark.parametrize("family", ["flux", "qwenimage"])
def test_autocast_of_a_bf16_model_runs_every_op_as_eager_does(family, emulated_kernels, unpatch_after):
    """CUDA autocast runs layer_norm, group_norm, rsqrt, pow, ... in float32 even for a bf16 model, so its eager
    chains are not the ones the kernels reproduce: every fused op refuses under autocast (CPU autocast, which does
    not upcast them, shows the refusal here; the kernels run once it is off)."""
    ref_model, model, inputs = twins(family, torch.bfloat16, seed=2)
    fp.patch(model)
    unpatch_after(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = out(ref_model, inputs), out(model, inputs)
    assert ref.dtype == got.dtype and torch.equal(got, ref)
    rep = fp.report(model)
    fused = [s for s in rep.sites if s.op in OPS]  # not FLUX's joint_tokens_view (a view of what is there, no math)
    assert fused and not any(s.fast for s in fused), str(rep)
    assert {reason for s in fused for reason in s.reasons} == {REASON_AUTOCAST}, str(rep)
    assert torch.equal(out(model, inputs), out(ref_model, inputs)) and fp.report(model).fast > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_outputs_and_every_gradient(family, checkpointing, dtype, unpatch_after):
    ref_model, model, inputs = twins(family, dtype, seed=3)
    fp.patch(model)
    unpatch_after(model)

    def step(m):
        m.train()
        if checkpointing:
            m.enable_gradient_checkpointing()
        key = FAMILIES[family][2]
        latents = _tensors(inputs[key], lambda t: t.clone().requires_grad_())
        sample = m(**{**inputs, key: latents}).sample
        sample = torch.stack(sample) if isinstance(sample, list) else sample
        sample.float().square().mean().backward()
        grad = torch.stack(_tensors(latents, lambda t: t.grad)) if isinstance(latents, list) else latents.grad
        return sample.detach(), grad, {n: p.grad for n, p in m.named_parameters()}

    (ref, ref_input_grad, ref_grads), (got, input_grad, grads) = step(ref_model), step(model)
    assert torch.equal(got, ref) and torch.equal(input_grad, ref_input_grad)
    assert grads.keys() == ref_grads.keys()
    missing = [n for n, g in ref_grads.items() if g is None]
    assert len(missing) < len(ref_grads) // 4  # the loss reaches (nearly) every parameter
    assert all((grads[n] is None) == (g is None) and (g is None or torch.equal(grads[n], g)) for n, g in ref_grads.items())


# --- memory features -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("order", ["offload_then_patch", "patch_then_offload"])
def test_group_offload(family, offload_type, order, unpatch_after):
    """accelerate's ``send_to_device`` rebuilds tuples (and tuple subclasses) from an iterator: the rotary tables
    must survive it (they are diffusers' own plain tuple)."""
    ref_model, model, inputs = twins(family, seed=4)
    cpu = torch.device("cpu")
    kwargs = dict(onload_device=cpu, offload_device=cpu, offload_type=offload_type)
    if offload_type == "block_level":
        kwargs["num_blocks_per_group"] = 1
    ref_model.enable_group_offload(**kwargs)
    if order == "offload_then_patch":
        model.enable_group_offload(**kwargs)
    fp.patch(model)
    unpatch_after(model)
    if order == "patch_then_offload":
        model.enable_group_offload(**kwargs)
    for _ in range(2):
        assert torch.equal(out(model, inputs), out(ref_model, inputs))


@pytest.mark.parametrize("family", FAMILIES)
def test_to_dtype_after_patch(family, unpatch_after):
    ref_model, model, inputs = twins(family, seed=5)
    fp.patch(model)
    unpatch_after(model)
    model.to(torch.float16)
    ref_model.to(torch.float16)
    half = lambda t: t.to(torch.float16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    inputs = {k: _tensors(v, half) if k not in ("img_ids", "txt_ids") else v for k, v in inputs.items()}
    assert torch.equal(out(model, inputs), out(ref_model, inputs))


# --- the rotary tables follow what pos_embed receives ----------------------------------------------------------


@pytest.mark.parametrize("write", ["numpy", "data"])
def test_flux_ids_written_without_a_version_bump(write, unpatch_after):
    """Writes through ``.numpy()`` or ``.data`` do not move a tensor's version counter: no table may outlive them."""
    ref_model, model, inputs = twins("flux", seed=6)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(out(model, inputs), out(ref_model, inputs))
    if write == "numpy":
        inputs["img_ids"].numpy()[:, 1] += 7
    else:
        inputs["img_ids"].data[:, 1] += 7
    assert torch.equal(out(model, inputs), out(ref_model, inputs))


def test_ernie_text_lens_written_without_a_version_bump(unpatch_after):
    ref_model, model, _ = twins("ernie", seed=7)
    inputs = ernie_image_inputs(model, batch=2, text_lens=(12, 5), seed=8)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(out(model, inputs), out(ref_model, inputs))
    inputs["text_lens"].numpy()[1] = 2
    assert torch.equal(out(model, inputs), out(ref_model, inputs))


def _rescale_ids(module, args, kwargs):
    return args, {**kwargs, "img_ids": kwargs["img_ids"] * 2}


class ShiftedFlux(FluxTransformer2DModel):
    """A user's subclass that moves the image positions (by an offset it may change) before diffusers' forward sees
    them."""

    offset = 3

    def forward(self, *args, img_ids=None, **kwargs):
        return super().forward(*args, img_ids=img_ids + self.offset, **kwargs)


def test_a_hook_added_later_that_changes_the_ids(unpatch_after):
    ref_model, model, inputs = twins("flux", seed=9)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(out(model, inputs), out(ref_model, inputs))
    for m in (model, ref_model):
        m.register_forward_pre_hook(_rescale_ids, with_kwargs=True)
    assert torch.equal(out(model, inputs), out(ref_model, inputs))


def test_a_subclass_that_changes_the_ids(unpatch_after):
    ref_model, base, inputs = twins("flux", seed=10)
    model = ShiftedFlux.from_config(base.config).to(torch.bfloat16)
    model.load_state_dict(base.state_dict())
    shifted_ref = ShiftedFlux.from_config(base.config).to(torch.bfloat16)
    shifted_ref.load_state_dict(base.state_dict())
    fp.patch(model)
    unpatch_after(model)
    for offset in (3, 3, 5):
        model.offset = shifted_ref.offset = offset
        assert torch.equal(out(model, inputs), out(shifted_ref, inputs))
    assert not torch.equal(out(model, inputs), out(ref_model, inputs))  # the shift matters


# --- concurrency -----------------------------------------------------------------------------------------------


def _interleaved(model, first_inputs, second_inputs):
    """Run `model` on `first_inputs` in thread A and on `second_inputs` in thread B, interleaved the way that would
    hand one thread's rotary table to the other if any state were shared: A enters the forward and stops before
    ``pos_embed``; B enters the forward and stops there too; A builds its table and goes on; then B. Events force
    this order every time."""
    results, errors = {}, []
    a_at, b_at, a_past = threading.Event(), threading.Event(), threading.Event()

    def before(module, args):
        name = threading.current_thread().name
        if name == "A" and not a_at.is_set():
            a_at.set()
            assert b_at.wait(60)
        elif name == "B" and not b_at.is_set():
            b_at.set()
            assert a_past.wait(60)

    def after(module, args, output):
        if threading.current_thread().name == "A":
            a_past.set()

    handles = [model.pos_embed.register_forward_pre_hook(before), model.pos_embed.register_forward_hook(after)]

    def work(name, inputs, start=None):
        try:
            if start is not None:
                assert start.wait(60)
            results[name] = out(model, inputs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            a_past.set(), b_at.set()

    threads = [threading.Thread(target=work, args=("A", first_inputs), name="A"),
               threading.Thread(target=work, args=("B", second_inputs, a_at), name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for h in handles:
        h.remove()
    assert not errors, errors
    return results["A"], results["B"]


def test_two_threads_on_one_flux_model(unpatch_after):
    """Same token count, other positions (grids 4x8 and 8x4): no table of one thread may reach the other."""
    ref_model, model, _ = twins("flux", seed=11)
    wide, tall = (flux_transformer_inputs(model, grid=g, seed=12) for g in ((4, 8), (8, 4)))
    fp.patch(model)
    unpatch_after(model)
    got_wide, got_tall = _interleaved(model, wide, tall)
    assert torch.equal(got_wide, out(ref_model, wide)) and torch.equal(got_tall, out(ref_model, tall))
    assert torch.equal(out(model, tall), out(ref_model, tall))  # and nothing stale is left behind


def test_two_threads_on_one_ernie_model(unpatch_after):
    ref_model, model, _ = twins("ernie", seed=13)
    first, second = (ernie_image_inputs(model, batch=2, text_lens=lens, seed=14) for lens in ((9, 4), (4, 9)))
    fp.patch(model)
    unpatch_after(model)
    got_first, got_second = _interleaved(model, first, second)
    assert torch.equal(got_first, out(ref_model, first)) and torch.equal(got_second, out(ref_model, second))
    assert torch.equal(out(model, second), out(ref_model, second))


def test_two_pipelines_in_two_threads(unpatch_after):
    pipes = [tiny_flux_pipeline(seed=s) for s in (15, 16)]
    refs = [tiny_flux_pipeline(seed=s) for s in (15, 16)]

    def generate(pipe, seed):
        pipe.set_progress_bar_config(disable=True)
        emb = prompt_embeddings(pipe, seed=seed)
        return pipe(**emb, height=32, width=32, num_inference_steps=2, output_type="latent",
                    generator=torch.Generator().manual_seed(seed)).images

    expected = [generate(p, s) for p, s in zip(refs, (1, 2))]
    for p in pipes:
        fp.patch(p)
        unpatch_after(p)
    results = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate(pipes[i], i + 1))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(torch.equal(r, e) for r, e in zip(results, expected))


# --- adapters, ControlNet, fused projections ---------------------------------------------------------------------


def _lora_config(rank=4):
    from peft import LoraConfig

    # init_lora_weights=False: random A and B, so the adapter really changes the output
    return LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"],
                      init_lora_weights=False)


@pytest.mark.parametrize("order", ["adapter_then_patch", "patch_then_adapter"])
def test_peft_lora_adapters(order, unpatch_after):
    pytest.importorskip("peft")
    ref_model, model, inputs = twins("flux", seed=17)

    def add(m):
        torch.manual_seed(0)
        m.add_adapter(_lora_config(), adapter_name="a")
        torch.manual_seed(1)
        m.add_adapter(_lora_config(), adapter_name="b")

    add(ref_model)
    if order == "adapter_then_patch":
        add(model)
    fp.patch(model)
    unpatch_after(model)
    if order == "patch_then_adapter":
        add(model)
    base = None
    for setup in (
        lambda m: m.set_adapters(["a", "b"], weights=[0.5, 1.0]),
        lambda m: m.set_adapters("a"),
        lambda m: m.disable_adapters(),
        lambda m: m.enable_adapters(),
        lambda m: m.fuse_lora(lora_scale=0.7),
        lambda m: m.unfuse_lora(),
        lambda m: m.delete_adapters("b"),
        lambda m: m.unload_lora(),
    ):
        setup(ref_model)
        setup(model)
        ref = out(ref_model, inputs)
        assert torch.equal(out(model, inputs), ref)
        base = ref if base is None else base
    assert not torch.equal(base, ref)  # the adapters changed the output (and unloading took them away)


def test_pipeline_load_unload_and_hotswap_lora(tmp_path, unpatch_after):
    peft = pytest.importorskip("peft")
    from diffusers import FluxPipeline

    donor = build_flux_transformer("flux-tiny", seed=18)
    paths = []
    for i in range(2):
        torch.manual_seed(i)
        donor.add_adapter(_lora_config(), adapter_name=f"l{i}")
        FluxPipeline.save_lora_weights(
            tmp_path / f"l{i}", transformer_lora_layers=peft.get_peft_model_state_dict(donor, adapter_name=f"l{i}")
        )
        paths.append(tmp_path / f"l{i}")
    ref_pipe, pipe = tiny_flux_pipeline(seed=19), tiny_flux_pipeline(seed=19)
    emb = prompt_embeddings(pipe, seed=3)

    def generate(p):
        p.set_progress_bar_config(disable=True)
        return p(**emb, height=32, width=32, num_inference_steps=2, output_type="latent",
                 generator=torch.Generator().manual_seed(4)).images

    fp.patch(pipe)
    unpatch_after(pipe)
    for p in (ref_pipe, pipe):
        p.enable_lora_hotswap(target_rank=4)
        p.load_lora_weights(paths[0], adapter_name="x")
    assert torch.equal(generate(pipe), generate(ref_pipe))
    for p in (ref_pipe, pipe):
        p.load_lora_weights(paths[1], adapter_name="x", hotswap=True)
    assert torch.equal(generate(pipe), generate(ref_pipe))
    for p in (ref_pipe, pipe):
        p.unload_lora_weights()
    assert torch.equal(generate(pipe), generate(ref_pipe))


def test_controlnet_residuals(unpatch_after):
    ref_model, model, inputs = twins("flux", seed=20)
    fp.patch(model)
    unpatch_after(model)
    gen = torch.Generator().manual_seed(21)
    tokens, inner = inputs["hidden_states"].shape[1], model.inner_dim
    dual = [torch.randn(1, tokens, inner, generator=gen).to(torch.bfloat16) for _ in model.transformer_blocks]
    single = [torch.randn(1, tokens, inner, generator=gen).to(torch.bfloat16) for _ in model.single_transformer_blocks]
    kwargs = dict(controlnet_block_samples=dual, controlnet_single_block_samples=single)
    ref = out(ref_model, inputs, **kwargs)
    assert torch.equal(out(model, inputs, **kwargs), ref)
    assert not torch.equal(ref, out(ref_model, inputs))


@pytest.mark.parametrize("order", ["fuse_then_patch", "patch_then_fuse"])
def test_fuse_qkv_projections(order, unpatch_after):
    ref_model, model, inputs = twins("flux", seed=22)
    ref_model.fuse_qkv_projections()
    if order == "fuse_then_patch":
        model.fuse_qkv_projections()
    fp.patch(model)
    unpatch_after(model)
    if order == "patch_then_fuse":
        model.fuse_qkv_projections()
    assert torch.equal(out(model, inputs), out(ref_model, inputs))
    for m in (model, ref_model):
        m.unfuse_qkv_projections()
    assert torch.equal(out(model, inputs), out(ref_model, inputs))


# --- attention backends ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["native", "_native_math"])
def test_attention_backend_set_while_patched(family, backend, unpatch_after):
    """The patched processors follow ``set_attention_backend`` as diffusers' do (the backends a CPU has)."""
    ref_model, model, inputs = twins(family, seed=23)
    fp.patch(model)
    unpatch_after(model)
    for m in (model, ref_model):
        m.set_attention_backend(backend)
    processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
    fused = [p for p in processors if type(p).__module__.startswith("diffusers_fastpath")]
    # FLUX, ERNIE-Image, Z-Image, Qwen-Image, Lumina2 and HunyuanVideo-1.5 run fused processors everywhere
    # (HunyuanVideo-1.5's token refiner keeps diffusers'); SD3 its joint attention's (the head concatenations; its QK
    # norms are swapped modules)
    expected = {"sd3": len([p for p in processors if "JointAttnProcessor2_0" in type(p).__name__]),
                "hunyuanvideo15": len([p for p in processors if "HunyuanVideo15" in type(p).__name__]),
                # Framepack's token refiner's AttnProcessor2_0 has no chain to fuse (the generic path leaves it)
                "hunyuan-framepack": len([p for p in processors if type(p).__name__ != "AttnProcessor2_0"]),
                }.get(family, len(processors))
    assert processors and len(fused) == expected, processors
    dispatching = [p for p in processors if hasattr(p, "_attention_backend")]  # Lumina2's, SD3's call SDPA themselves
    assert dispatching or family in ("lumina2", "sd3")
    assert all(str(p._attention_backend) in (backend, f"AttentionBackendName.{backend.upper().lstrip('_')}")
               or getattr(p._attention_backend, "value", None) == backend for p in dispatching)
    assert torch.equal(out(model, inputs), out(ref_model, inputs))


# --- platforms -------------------------------------------------------------------------------------------------


@pytest.fixture
def no_kernels_yet(monkeypatch):
    """A process that has not tried to load the kernels yet; the loader state is restored afterwards."""
    monkeypatch.setattr(_build, "unavailable", None)
    monkeypatch.setattr(_build, "load_seconds", None)
    builds = []
    monkeypatch.setattr(_build, "_build_and_load", lambda: builds.append("nvcc"))
    # the second way, NVRTC, is absent too in these tests (on a GPU machine it would succeed where nvcc is missing)
    monkeypatch.setattr(_build, "_nvrtc_missing", lambda: "no NVRTC library (simulated)")
    monkeypatch.setattr(_build, "_compile_and_load_nvrtc", lambda: builds.append("nvrtc"))
    return builds


def _force_kernel_path(monkeypatch):
    """Let every op's guard admit CPU tensors, so that the op reaches its kernel (and so the loader)."""
    for op in OPS.values():
        monkeypatch.setattr(op, "guard", lambda *a, **k: None)


@pytest.mark.parametrize("platform", ["rocm", "no_nvcc", "no_ninja"])
def test_no_way_to_get_kernels_warns_once_and_stays_exact(platform, monkeypatch, no_kernels_yet, fastpath_log,
                                                          unpatch_after):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    if platform == "rocm":
        monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
        expected = "this is a ROCm build of torch (7.0.0)"
    elif platform == "no_nvcc":
        monkeypatch.setattr(cpp_extension, "_find_cuda_home", lambda: None)
        expected = "no CUDA compiler found (nvcc: CUDA_HOME=unset, none on PATH)"
    else:
        nvcc_home = _fake_toolkit(monkeypatch)
        monkeypatch.setattr(cpp_extension, "_find_cuda_home", lambda: nvcc_home)
        monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
        expected = "ninja is not installed"
    ref_model, model, inputs = twins("flux", seed=24)
    ref = out(ref_model, inputs)
    fp.patch(model)
    unpatch_after(model)
    _force_kernel_path(monkeypatch)
    for _ in range(2):
        assert torch.equal(out(model, inputs), ref)
    warnings = [r.getMessage() for r in fastpath_log.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and expected in warnings[0], warnings
    if platform != "rocm":  # the one warning names both ways and what would fix each
        assert "no NVRTC library (simulated)" in warnings[0] and "pip install nvidia-cuda-nvrtc" in warnings[0]
    assert no_kernels_yet == []  # no build was attempted, let alone one per op
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the report on the GPU machine this stands for
    rep = fp.report(model)
    assert str(rep).splitlines()[0] == f"diffusers_fastpath: no CUDA kernels: {_build.unavailable}"
    # the two sites that need no compiled kernel (a view; aten's GEMMs into the joint values) run their fast paths
    assert all(s.fast == 0 and set(s.reasons) == {REASON_NO_KERNELS} for s in rep.sites if s.op not in NO_KERNEL_OPS), [s for s in rep.sites if s.op not in NO_KERNEL_OPS and not (s.fast == 0 and set(s.reasons) == {REASON_NO_KERNELS})]
    assert all(s.fast > 0 and s.fallback == 0 for s in rep.sites if s.op in NO_KERNEL_OPS)


NO_KERNEL_OPS = ("joint_tokens_view", "linear_cat")


def _fake_toolkit(monkeypatch):
    import tempfile
    from pathlib import Path

    home = Path(tempfile.mkdtemp())
    (home / "bin").mkdir()
    (home / "bin" / "nvcc").write_text("")
    return str(home)


def test_a_failed_build_is_tried_once(monkeypatch, no_kernels_yet, fastpath_log, unpatch_after):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv("CUDA_HOME", _fake_toolkit(monkeypatch))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    attempts = []

    def failing_build():
        attempts.append(1)
        raise OSError("Could not load this library: diffusers_fastpath_C.so")

    monkeypatch.setattr(_build, "_build_and_load", failing_build)
    ref_model, model, inputs = twins("flux", seed=25)
    fp.patch(model)
    unpatch_after(model)
    _force_kernel_path(monkeypatch)
    for _ in range(2):
        assert torch.equal(out(model, inputs), out(ref_model, inputs))
    assert attempts == [1]
    warnings = [r.getMessage() for r in fastpath_log.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "failed to build or load (OSError: Could not load" in warnings[0]


def test_disable_switch_set_after_import_takes_effect(monkeypatch, unpatch_after):
    ref_model, model, inputs = twins("flux", seed=26)
    fp.patch(model)
    unpatch_after(model)
    out(model, inputs)
    monkeypatch.setenv(ENV_DISABLE, "1")  # after import, after patch: read per call
    assert torch.equal(out(model, inputs), out(ref_model, inputs))
    rep = fp.report(model)
    assert all(s.reasons.get(REASON_ENV) for s in rep.sites if s.op != "joint_tokens_view")
    assert rep.ops["gated_residual"] == REASON_ENV
    monkeypatch.delenv(ENV_DISABLE)
    assert fp.report(model).ops["gated_residual"] == "enabled"


def test_ip_adapter_processors_run_beside_the_patched_ones(unpatch_after):
    """IP-adapter processors stay in place (their blocks return three outputs: the mirrored block adds the IP
    attention output as diffusers does) and the others are patched."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    ref_model, model, inputs = twins("flux", seed=27)
    for m in (ref_model, model):
        for i, block in enumerate(m.transformer_blocks):
            torch.manual_seed(i)
            ip = FluxIPAdapterAttnProcessor(hidden_size=m.inner_dim, cross_attention_dim=m.inner_dim, num_tokens=(4,))
            block.attn.set_processor(ip.to(torch.bfloat16))
    fp.patch(model)
    unpatch_after(model)
    assert fp.report(model).models[0].processors == len(model.single_transformer_blocks)
    gen = torch.Generator().manual_seed(28)
    ip_tokens, other = (torch.randn(1, 4, model.inner_dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    call = lambda m, t: out(m, inputs, joint_attention_kwargs={"ip_hidden_states": [t]})  # noqa: E731
    ref = call(ref_model, ip_tokens)
    assert torch.equal(call(model, ip_tokens), ref) and not torch.equal(ref, call(ref_model, other))


# --- cells diffusers' own test suite exercises (issue 43's works-with list) ---------------------------------------
# Each with the kernels emulated (`emulated_kernels`): the fused paths' wiring runs and is counted, not only their
# CPU fallbacks; each ends with the patch undone and the model running diffusers' own code again.


def _no_fastpath_left(model) -> bool:
    """After `unpatch`: no module, processor or attribute of this package is left on the model."""
    return not any(type(m).__module__.startswith("diffusers_fastpath")
                   or type(getattr(m, "processor", None)).__module__.startswith("diffusers_fastpath")
                   or any(k.startswith("_fastpath") for k in vars(m)) or "forward" in vars(m)
                   for m in model.modules())


def _dora_config(rank=4):
    from peft import LoraConfig

    # DoRA: the weight's norm is a learnt magnitude (lora_magnitude_vector), the LoRA product only its direction
    return LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, use_dora=True,
                      target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out"])


@pytest.mark.parametrize("order", ["adapter_then_patch", "patch_then_adapter"])
def test_dora_adapters(order, emulated_kernels, unpatch_after):
    pytest.importorskip("peft")
    ref_model, model, inputs = twins("flux", seed=29)
    plain = out(ref_model, inputs)

    def add(m):
        torch.manual_seed(0)
        m.add_adapter(_dora_config(), adapter_name="dora")

    add(ref_model)
    if order == "adapter_then_patch":
        add(model)
    fp.patch(model)
    unpatch_after(model)
    if order == "patch_then_adapter":
        add(model)
    ref = out(ref_model, inputs)
    assert not torch.equal(ref, plain)  # the adapter changes the output
    assert torch.equal(out(model, inputs), ref)
    assert fp.report(model).fast > 0  # fused sites outside the adapted layers still ran
    for m in (ref_model, model):
        m.disable_adapters()
    assert torch.equal(out(model, inputs), out(ref_model, inputs))
    for m in (ref_model, model):
        m.enable_adapters()
        m.fuse_lora(lora_scale=0.5)
    assert torch.equal(out(model, inputs), out(ref_model, inputs))
    fp.unpatch(model)
    assert _no_fastpath_left(model) and torch.equal(out(model, inputs), out(ref_model, inputs))


# the families whose model class has diffusers' AttentionMixin (``attn_processors``); ERNIE-Image's, Z-Image's and
# Lumina2's have none
ATTENTION_FAMILIES = ["flux", "qwenimage", "hunyuanvideo15", "sd3"]


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_attn_processors_getter_and_setter_round_trip(family, emulated_kernels, unpatch_after):
    """diffusers' attention tests (``attn_processors``, ``set_attn_processor`` with a dict or one processor, the
    count check, ``get_processor``/``set_processor``) on a patched model. None of the patched classes has
    ``set_default_attn_processor`` (diffusers' own suite skips it for their dedicated processors); its equivalent is
    setting every processor to the class diffusers gives it, which this does."""
    ref_model, model, inputs = twins(family, seed=30)
    ref = out(ref_model, inputs)
    fp.patch(model)
    unpatch_after(model)
    patched = model.attn_processors
    assert patched.keys() == ref_model.attn_processors.keys()
    fused = {k for k, p in patched.items() if type(p).__module__.startswith("diffusers_fastpath")}
    assert fused or family == "sd3"  # SD3's fusions are its blocks' and QK norms', its processors stay diffusers'
    model.set_attn_processor(dict(patched))  # the getter's dict, set back (set_attn_processor pops from it)
    assert model.attn_processors == patched and torch.equal(out(model, inputs), ref)
    with pytest.raises(ValueError, match="does not match the number of attention layers"):
        model.set_attn_processor(dict(list(patched.items())[1:]))
    # diffusers' defaults: the processor classes the unpatched twin holds, fresh
    defaults = {k: type(p)() for k, p in ref_model.attn_processors.items()}
    model.set_attn_processor(dict(defaults))
    assert all(type(model.attn_processors[k]) is type(p) for k, p in defaults.items())
    assert torch.equal(out(model, inputs), ref)
    for key, processor in patched.items():  # one by one, through set_processor/get_processor
        attention = model.get_submodule(key.removesuffix(".processor"))
        attention.set_processor(processor)
        assert attention.get_processor() is processor
    assert model.attn_processors == patched and torch.equal(out(model, inputs), ref)
    fp.unpatch(model)
    assert _no_fastpath_left(model) and torch.equal(out(model, inputs), ref)


def _kv_pipeline(transformer, seed):
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline

    vae = build_flux2_vae("flux2-tiny", torch.bfloat16, seed=seed + 1,
                          latent_channels=transformer.config.in_channels // 4)
    return Flux2KleinKVPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                tokenizer=None, transformer=transformer, is_distilled=True)


@pytest.mark.parametrize("order", ["pipeline_then_patch", "patch_then_pipeline"])
def test_flux2_klein_kv_cache(order, emulated_kernels, unpatch_after):
    """``Flux2KleinKVPipeline``: its own attention processors (set when the pipeline is built), step 0 with the
    reference image's tokens extracting their K/V into a ``Flux2KVCache``, later steps reading them from it."""
    import numpy as np
    import PIL.Image

    ref_pipe = _kv_pipeline(build_flux2_transformer("flux2-klein-tiny", seed=31), 31)
    transformer = build_flux2_transformer("flux2-klein-tiny", seed=31)
    if order == "patch_then_pipeline":
        fp.patch(transformer)
        unpatch_after(transformer)
    pipe = _kv_pipeline(transformer, 31)
    if order == "pipeline_then_patch":
        fp.patch(pipe)
        unpatch_after(pipe)
    image = PIL.Image.fromarray((np.random.RandomState(32).rand(64, 64, 3) * 255).astype("uint8"))
    calls = []
    ref_pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(k.get("kv_cache_mode")),
                                                   with_kwargs=True)

    def generate(p, **kwargs):
        p.set_progress_bar_config(disable=True)
        emb = flux2_prompt_embeddings(p, seed=33)
        emb.pop("guidance_scale")
        return p(**emb, height=32, width=32, num_inference_steps=3, output_type="latent",
                 generator=torch.Generator().manual_seed(34), **kwargs).images

    ref = generate(ref_pipe, image=image)
    assert calls == ["extract", "cached", "cached"]  # the cache is used
    assert torch.equal(generate(pipe, image=image), ref)
    assert fp.report(pipe.transformer).fast > 0
    assert torch.equal(generate(pipe), generate(ref_pipe))  # no reference image: the plain forward
    fp.unpatch(pipe.transformer)
    assert _no_fastpath_left(pipe.transformer) and torch.equal(generate(pipe, image=image), ref)


@pytest.mark.parametrize("low_cpu_mem_usage", [True, False], ids=["low_cpu_mem", "full_init"])
def test_sharded_save_and_load_then_patch(tmp_path, low_cpu_mem_usage, emulated_kernels, unpatch_after):
    """A tiny model saved in shards (``max_shard_size``), loaded with and without ``low_cpu_mem_usage`` (accelerate's
    empty-weights init, then the shards assigned), patched: equal to the model it was saved from. A patched model
    saves the same checkpoint (the patch adds no parameter or buffer)."""
    source, twin, inputs = twins("flux", seed=35)
    ref = out(source, inputs)
    fp.patch(twin)
    unpatch_after(twin)
    for name, m in (("unpatched", source), ("patched", twin)):
        m.save_pretrained(tmp_path / name, max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "unpatched").glob("*.safetensors"))
    assert len(shards) > 2 and shards == sorted(p.name for p in (tmp_path / "patched").glob("*.safetensors"))
    for name in ("unpatched", "patched"):
        model = FluxTransformer2DModel.from_pretrained(tmp_path / name, low_cpu_mem_usage=low_cpu_mem_usage,
                                                       torch_dtype=torch.bfloat16)
        assert torch.equal(out(model, inputs), ref)
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(out(model, inputs), ref) and fp.report(model).fast > 0
        fp.unpatch(model)
        assert _no_fastpath_left(model)


def _generate_flux(pipe, **kwargs):
    pipe.set_progress_bar_config(disable=True)
    return pipe(**prompt_embeddings(pipe, seed=36), height=32, width=32, num_inference_steps=2, output_type="latent",
                generator=torch.Generator().manual_seed(37), **kwargs).images


def _generate_qwenimage(pipe, **kwargs):
    pipe.set_progress_bar_config(disable=True)
    return pipe(**qwenimage_prompt_embeddings(pipe, seed=36), height=32, width=32, num_inference_steps=2,
                true_cfg_scale=2.0, output_type="latent", generator=torch.Generator().manual_seed(37), **kwargs).images


PIPELINES = {  # a 2-step pipeline built offline: (build, generate)
    "flux": (lambda seed: tiny_flux_pipeline(seed=seed), _generate_flux),
    # true CFG with prompts of two lengths (their masks repeated per image)
    "qwenimage": (lambda seed: qwenimage_pipeline(build_qwenimage_transformer(seed=seed, num_layers=1)),
                  _generate_qwenimage),
}


@pytest.mark.parametrize("family", PIPELINES)
def test_num_images_per_prompt(family, emulated_kernels, unpatch_after):
    build, generate = PIPELINES[family]
    ref_pipe, pipe = build(38), build(38)
    fp.patch(pipe)
    unpatch_after(pipe)
    ref = generate(ref_pipe, num_images_per_prompt=2)
    assert ref.shape[0] == 2 and not torch.equal(ref[0], ref[1])  # two images from one prompt, other noise
    assert torch.equal(generate(pipe, num_images_per_prompt=2), ref)
    assert fp.report(pipe).fast > 0
    fp.unpatch(pipe)
    assert _no_fastpath_left(pipe.transformer) and torch.equal(generate(pipe, num_images_per_prompt=2), ref)


def test_callback_on_step_end_that_changes_the_latents(emulated_kernels, unpatch_after):
    """A callback that reads and rewrites the latents after each step (as diffusers' pipeline tests do): every step's
    latents, and the result, equal the unpatched pipeline's under the same callback."""
    ref_pipe, pipe = tiny_flux_pipeline(seed=39), tiny_flux_pipeline(seed=39)
    fp.patch(pipe)
    unpatch_after(pipe)

    def run(p):
        seen = []

        def callback(p_, step, timestep, kwargs):
            seen.append((step, kwargs["latents"].clone(), kwargs["prompt_embeds"].clone()))
            return {"latents": kwargs["latents"] * 0.9 + 0.01 * step}

        result = _generate_flux(p, callback_on_step_end=callback,
                                callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])
        return seen, result

    (ref_seen, ref), (seen, got) = run(ref_pipe), run(pipe)
    assert [s[0] for s in ref_seen] == [0, 1] and not torch.equal(ref, _generate_flux(ref_pipe))  # it ran, and mattered
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(seen, ref_seen))
    assert len(seen) == 2 and torch.equal(got, ref)
    fp.unpatch(pipe)
    assert _no_fastpath_left(pipe.transformer) and torch.equal(run(pipe)[1], ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatch_after_a_hook_bound_the_patched_forward(family):
    """Group offloading enabled after `patch` wraps each block's bound (patched) forward; after `unpatch` the model
    must compute as diffusers wrote it, through those hooks too (Qwen-Image 2.1's rewritten forward, calling a method
    only its subclass has, once crashed there), and no fused op may run any more."""
    ref_model, model, inputs = twins(family, seed=8)
    cpu = torch.device("cpu")
    kwargs = dict(onload_device=cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1)
    fp.patch(model)
    model.enable_group_offload(**kwargs)
    ref_model.enable_group_offload(**kwargs)
    out(model, inputs)
    sites = [s for m in model.modules() for _, s in sites_of(m)]
    fp.unpatch(model)
    before = [(s.fast, dict(s.fallback)) for s in sites]
    assert torch.equal(out(model, inputs), out(ref_model, inputs))
    assert [(s.fast, dict(s.fallback)) for s in sites] == before  # nothing of the patch ran after `unpatch`


@pytest.mark.parametrize("value, disabled", [("1", True), (" TRUE ", True), ("on", True), ("0", False), ("", False),
                                             (None, False)])
def test_off_switch_read_per_call_as_os_environ_reads_it(monkeypatch, value, disabled):
    """The per-call read of ``DIFFUSERS_FASTPATH_DISABLE`` (one lookup in os.environ's own dict) sees what
    ``os.environ.get`` sees, set and deleted after import."""
    from diffusers_fastpath.ops._policy import _env_disabled

    if value is None:
        monkeypatch.delenv(ENV_DISABLE, raising=False)
    else:
        monkeypatch.setenv(ENV_DISABLE, value)
    assert _env_disabled() is disabled
    assert (os.environ.get(ENV_DISABLE, "").strip().lower() in ("1", "true", "yes", "on")) is disabled


def test_autocast_question_is_the_tensors_devices():
    """`autocast_on` answers ``torch.is_autocast_enabled`` of the first tensor's device, and for a device autocast
    does not know (meta) that it is off, without raising."""
    from diffusers_fastpath.ops._policy import autocast_on

    x = torch.zeros(2)
    assert autocast_on((None, x)) is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_on((None, x)) is True
        assert autocast_on((None,)) is False
    prev = torch.is_autocast_enabled("cuda")
    torch.set_autocast_enabled("cuda", True)
    try:
        assert autocast_on((x,)) is False  # on for CUDA only: not the CPU tensor's
    finally:
        torch.set_autocast_enabled("cuda", prev)
    assert autocast_on((torch.empty(2, device="meta"),)) is False
