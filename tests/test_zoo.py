"""The zoo of uncovered diffusers DiTs (`diffusers_fastpath.testing.zoo`): every entry builds tiny with every
parameter random, runs a deterministic finite forward on the inputs its builder draws, responds to fresh inputs,
takes a batch, and has a published config that builds; `build` loads tensors in the dtypes `from_pretrained` does."""

from __future__ import annotations

import pytest
import torch

from diffusers_fastpath.testing import zoo

NAMES = sorted(zoo.ZOO)

# One class per row of COVERAGE.md's "Uncovered image / video / audio DiTs" table (rows naming several classes are
# several classes): the zoo must hold each exactly once.
UNCOVERED = {
    "Flux3Transformer2DModel", "QwenImage21Transformer2DModel", "LTX2VideoTransformer3DModel",
    "WanVACETransformer3DModel", "WanAnimate2Transformer3DModel", "Kandinsky6Transformer3DModel",
    "Kandinsky6SRTransformer3DModel", "Kandinsky5Transformer3DModel", "Krea2Transformer2DModel",
    "Ideogram4Transformer2DModel", "Cosmos3OmniTransformer", "MiniMaxH3Transformer3DModel",
    "HunyuanVideoFramepackTransformer3DModel", "SkyReelsV2Transformer3DModel", "ChronoEditTransformer3DModel",
    "WanAnimateTransformer3DModel", "HeliosTransformer3DModel", "AnyFlowTransformer3DModel",
    "AnyFlowFARTransformer3DModel", "SanaWMLTX2RefinerTransformer3DModel", "MotifVideoTransformer3DModel",
    "JoyImageEditTransformer3DModel", "JoyImageEditPlusTransformer3DModel", "SanaVideoTransformer3DModel",
    "SanaTransformer2DModel", "BriaFibo2Transformer2DModel", "CosmosTransformer3DModel", "CogView4Transformer2DModel",
    "CogView3PlusTransformer2DModel", "GlmImageTransformer2DModel", "AuraFlowTransformer2DModel",
    "PRXTransformer2DModel", "HiDreamImageTransformer2DModel", "NucleusMoEImageTransformer2DModel",
    "CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel", "EasyAnimateTransformer3DModel",
    "MochiTransformer3DModel", "AllegroTransformer3DModel", "PixArtTransformer2DModel", "LatteTransformer3DModel",
    "DiTTransformer2DModel", "HunyuanDiT2DModel", "LuminaNextDiT2DModel", "OmniGenTransformer2DModel",
    "StableAudio3DiTModel", "AceStepTransformer1DModel", "LongCatAudioDiTTransformer",
    "MiniMaxMusic3Transformer1DModel", "StableAudioDiTModel", "SanaWMTransformer3DModel",
}


def _sample(out) -> torch.Tensor:
    """The predicted sample of a forward's output: the first tensor of a tuple / list (Wan-Animate 2 returns one
    tensor per sample, MiniMax-H3 video and audio, Cosmos 3 lists per modality)."""
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


def _cpu_entry(name):
    entry = zoo.ZOO[name]
    if entry.skip:
        pytest.skip(f"{name}: {entry.skip}")
    return entry


def _forward(model, kwargs):
    with torch.no_grad():
        return _sample(model(**kwargs))


def test_zoo_holds_every_uncovered_class_once():
    classes = [zoo.ZOO[n].cls for n in NAMES]
    names = [c.__name__ for c in classes]
    assert sorted(names) == sorted(UNCOVERED)
    from diffusers import ModelMixin

    assert all(issubclass(c, ModelMixin) for c in classes)


@pytest.mark.parametrize("name", NAMES)
def test_zoo_tiny_forward_is_deterministic_with_random_weights(name):
    entry = _cpu_entry(name)
    dtype = entry.cpu_dtype or torch.bfloat16
    model = zoo.build(name, dtype=dtype)
    assert not model.training
    zero = [n for n, p in model.named_parameters() if not p.detach().any()]
    assert not zero, f"parameters left all zero: {zero[:5]}"
    kwargs = zoo.inputs(name, model, seed=1)
    first = _forward(model, kwargs)
    second = _forward(model, kwargs)
    assert first.is_floating_point() and first.numel() > 0
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)
    # fresh inputs give a fresh prediction: the inputs reach the output (no dead path from the latents)
    other = _forward(model, zoo.inputs(name, model, seed=2))
    assert other.shape == first.shape and not torch.equal(other, first)


@pytest.mark.parametrize("name", NAMES)
def test_zoo_tiny_forward_takes_a_batch(name):
    entry = _cpu_entry(name)
    model = zoo.build(name, dtype=entry.cpu_dtype or torch.bfloat16, seed=3)
    single = _forward(model, zoo.inputs(name, model, batch=1, seed=4))
    batch = _forward(model, zoo.inputs(name, model, batch=2, seed=4))
    assert torch.isfinite(batch).all()
    # every builder puts the batch first, except Cosmos 3 (one packed sample) and Wan-Animate 2 (per-sample lists)
    if batch.shape != single.shape:
        assert batch.shape[0] == 2 * single.shape[0] and batch.shape[1:] == single.shape[1:]


def test_inputs_are_drawn_fresh_per_seed():
    model = zoo.build("wan-vace")
    a, b, a2 = (zoo.inputs("wan-vace", model, seed=s) for s in (1, 2, 1))
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, a2[k]), k
            assert not torch.equal(v, b[k]), k
    assert a["hidden_states"].dtype == torch.bfloat16 and a["timestep"].dtype == torch.float32


def test_build_loads_tensors_in_from_pretrained_dtypes(tmp_path):
    """`build` gives every state-dict tensor the dtype ``from_pretrained(torch_dtype=bf16)`` gives it: bf16, fp32 for
    ``_keep_in_fp32_modules`` (Wan-VACE: time_embedder, norms, scale_shift_table), and bf16 for a persistent buffer
    the class builds in fp32 (OmniGen's pos_embed)."""
    for name in ("wan-vace", "omnigen"):
        model = zoo.build(name)
        model.save_pretrained(tmp_path / name)
        loaded = type(model).from_pretrained(tmp_path / name, torch_dtype=torch.bfloat16)
        ours = {k: v.dtype for k, v in model.state_dict().items()}
        theirs = {k: v.dtype for k, v in loaded.state_dict().items()}
        assert ours == theirs
        assert torch.float32 in ours.values() if name == "wan-vace" else torch.float32 not in ours.values()


def test_build_full_without_a_published_config_raises():
    name = next(n for n in NAMES if zoo.ZOO[n].full_config is None)
    with pytest.raises(ValueError, match="no published config"):
        zoo.build(name, full=True)


@pytest.mark.parametrize("name", [n for n in NAMES if zoo.ZOO[n].full_config is not None])
def test_zoo_full_config_builds(name):
    """The published config constructs (on the meta device: shapes only, no memory) to a multi-billion-parameter
    model at most 50 B (Kandinsky 6, the largest, is 48.2 B) and at least the tiny one's size."""
    entry = zoo.ZOO[name]
    with torch.device("meta"):
        model = entry.cls(**entry.full_config)
    params = sum(p.numel() for p in model.parameters())
    assert 0.5e9 < params < 50e9, params


@pytest.mark.parametrize("name", [n for n in NAMES if zoo.ZOO[n].full_size])
def test_zoo_full_size_inputs_build(name):
    """The published resolution's inputs build (for the tiny model: the builders read channels from the config), so
    the bench's ``inputs(name, model, full=True)`` has the right knobs; the latents hold the tokens of that size."""
    entry = _cpu_entry(name)
    model = zoo.build(name, dtype=entry.cpu_dtype or torch.bfloat16)
    tiny, full = zoo.inputs(name, model), zoo.inputs(name, model, full=True)
    assert tiny.keys() == full.keys() or name == "flux3"  # FLUX.3: image-to-image tiny, text-to-image full
    first = lambda kw: _sample(next(v for v in kw.values() if isinstance(v, (torch.Tensor, list))))  # noqa: E731
    assert first(full).numel() > 16 * first(tiny).numel()


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_zoo_tiny_forward_is_deterministic_on_cuda(name):
    """The tiny model on CUDA in bf16 (CPU-skipped entries included): two forwards equal (what the generic path's
    first-forward verification relies on), finite."""
    model = zoo.build(name, device="cuda")
    kwargs = zoo.inputs(name, model, batch=2, seed=1)
    first, second = _forward(model, kwargs), _forward(model, kwargs)
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)


BENCH = ["wan-vace", "hunyuan-framepack", "sana", "cogview4", "auraflow"]


@pytest.mark.gpu
@pytest.mark.full_size
@pytest.mark.parametrize("name", BENCH)
def test_zoo_full_size_forward_runs(name):
    """The published config on the GPU at the published resolution (the issue's bench models): a finite forward of
    the latents' shape."""
    model = zoo.build(name, device="cuda", full=True)
    kwargs = zoo.inputs(name, model, full=True)
    out = _forward(model, kwargs)
    assert torch.isfinite(out).all()
    assert out.shape[0] == 1
    del model
    torch.cuda.empty_cache()
