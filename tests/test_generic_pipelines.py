"""The generic path inside the zoo classes' own diffusers pipelines (`diffusers_fastpath.testing.zoo.pipelines`): a
2-step generation (with CFG where the pipeline runs it) patched is ``torch.equal`` to unpatched, the transformer
passes its verification (stays patched), its sites count the generation's calls (the fused paths' wiring runs under
emulated kernels), some of its forwards run trusted (past the verified first one of their signature), and unpatch
restores every module class of every component."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import ModularPipeline
from diffusers.hooks import HookRegistry, ModelHook
from torch.utils import _pytree as pytree

import diffusers_fastpath as fp
from diffusers_fastpath._state import STATE_ATTR, sites_of
from diffusers_fastpath.patching import UnsupportedModelError, _adapter_for
from diffusers_fastpath.testing.zoo import PIPELINES

# classes whose chains no pattern matches yet (COVERAGE.md): patched with no site, verified all the same
NO_SITE = {"kandinsky6": "its modulate / gate chains are helper calls (apply_scale_shift, apply_gate_sum)"}
# classes whose sites count every call but fall back in the pipeline (the wiring is reached, the kernel refuses)
NO_FAST = {"cogvideox": "at batch 2 (CFG) the gates' updates are slices of the joint attention / FF output "
                        "(hidden_states[:, text_len:]): not contiguous, every gated residual falls back"}
# classes whose every site that runs takes the fast path in the pipeline (the streams made contiguous: no fallback)
NO_FALLBACK = ("wan-vace", "skyreels-v2", "chronoedit", "hunyuan-framepack", "cogview4", "flux3", "qwen-image-21",
               "ideogram4")


class _CountCalls(ModelHook):
    def __init__(self, sink: list) -> None:
        super().__init__()
        self.sink = sink

    def pre_forward(self, module, *args, **kwargs):
        self.sink.append(1)
        return args, kwargs


def _generate(pipe, call):
    # (a ModularPipeline returns what its call's `output` names, and takes no return_dict)
    plain = {} if isinstance(pipe, ModularPipeline) else dict(return_dict=False)
    out = pipe(**call, generator=torch.Generator().manual_seed(1), **plain)
    leaves = [torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in pytree.tree_leaves(out)]
    leaves = [t for t in leaves if isinstance(t, torch.Tensor)]
    assert leaves, f"no tensor in the output: {type(out)}"
    return [t.clone() for t in leaves]


def _modules(pipe):
    return {name: comp for name, comp in pipe.components.items() if isinstance(comp, torch.nn.Module)}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_generic_pipeline_patched_equals_unpatched(name, emulated_kernels):
    pipe, call = PIPELINES[name]()
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer
    classes = {k: [type(m) for m in comp.modules()] for k, comp in _modules(pipe).items()}
    # (Ideogram 4's pipeline holds a second transformer of the class, for its unconditional branch)
    transformers = {k for k, comp in _modules(pipe).items() if type(comp) is type(transformer)}
    forwards = []
    # counted by a diffusers hook (an instance-level wrapper, as offloading's): a torch hook would make every call
    # run as diffusers wrote it, unchecked (`verify.foreign_hooks`); the check's reference forward passes it too
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.register_hook(_CountCalls(forwards), "count_calls")
    try:
        ref = _generate(pipe, call)
        unpatched_forwards = len(forwards)
        assert all(torch.isfinite(t.float()).all() for t in ref), f"{name}: non-finite reference"
        assert any(t.float().std() > 0 for t in ref), f"{name}: flat reference"
        fp.patch(pipe)
        try:
            # the generic path takes the transformers only; other components only through a family adapter (the
            # AutoencoderKL): no audio VAE or vocoder, whose decode no forward-level verification would see
            patched = [k for k, comp in _modules(pipe).items() if STATE_ATTR in comp.__dict__]
            assert all(k in transformers or _adapter_for(pipe.components[k]) is not None for k in patched), patched
            state = transformer.__dict__.get(STATE_ATTR)
            assert state is not None and state.verifier is not None, f"{name}: not patched by the generic path"
            sites = [s for m in transformer.modules() for _, s in sites_of(m)]
            assert sites or name in NO_SITE, f"{name}: no fused site"
            forwards.clear()
            out = _generate(pipe, call)
            assert all(STATE_ATTR in pipe.components[k].__dict__ for k in patched), \
                f"{name}: unpatched by its verification"
            assert len(out) == len(ref) and all(torch.equal(a, b) for a, b in zip(out, ref)), \
                f"{name}: patched generation differs from unpatched"
            verified = len(state.verifier.verified)
            # the first forward of each signature ran both ways (its reference through the counting hook too); the
            # others ran patched only, trusted
            calls = len(forwards) - verified
            assert calls == unpatched_forwards and 1 <= verified < calls, (verified, len(forwards))
            assert not state.verifier.as_written, dict(state.verifier.as_written)
            if name not in NO_SITE:
                calls = sum(s.fast + sum(s.fallback.values()) for s in sites)
                assert calls > 0 and (name in NO_FAST or any(s.fast > 0 for s in sites)), sites
            if name in NO_FALLBACK:
                assert not any(s.fallback for s in sites), sites
        finally:
            fp.unpatch(pipe)
    finally:
        registry.remove_hook("count_calls", recurse=False)
    assert {k: [type(m) for m in comp.modules()] for k, comp in _modules(pipe).items()} == classes


def test_generic_path_refuses_autoencoders_and_vocoders_by_module():
    """Regression: MMAudioVAE and MMAudioVocoder (Kandinsky 6's audio decoder) hold repeated blocks, and their names
    say no "Autoencoder", so the generic path took them; a pipeline calls the VAE's ``decode``, which the model-level
    verification (a hook on ``forward``) never sees. Classes of diffusers' ``models.autoencoders`` are refused."""
    from diffusers import MMAudioVAE, MMAudioVocoder

    vae = MMAudioVAE(mel_bins=8, latent_channels=4, hidden_channels=8, channel_multipliers=(1,), layers_per_block=1,
                     n_fft=1024, hop_length=512)
    vocoder = MMAudioVocoder(num_mels=8, upsample_initial_channel=8, upsample_rates=(8, 8, 8),
                             upsample_kernel_sizes=(16, 16, 16), resblock_kernel_sizes=(3,),
                             resblock_dilation_sizes=((1,),))
    for model in (vae, vocoder):
        with pytest.raises(UnsupportedModelError, match="autoencoder or vocoder"):
            fp.patch(model)
        assert STATE_ATTR not in model.__dict__


@pytest.mark.parametrize("name", ["ideogram4", "krea2"])
def test_zoo_full_size_generation_row_on_tiny_pipelines(name, emulated_kernels, tool):
    """tools/zoo_full_size.py's ``--generation`` (what the GPU runs at full size), on the tiny pipeline on a CPU: 3
    steps (Ideogram 4's 2-weight guidance schedule stretched to them), the output and the final latents (a modular
    pipeline's state; Krea 2's through its step-end callback) identical patched and eager, the transformer kept after
    its verification, and the row's sites every fused site of the patched pipeline (Ideogram 4's two transformers)."""
    zoo_full_size = tool("zoo_full_size")
    row = zoo_full_size.generation(name, 3, 64, 64, device="cpu", full=False)
    row = [c.strip() for c in row.strip("| ").split(" | ")]
    cells = dict(zip(zoo_full_size.GENERATION_COLUMNS, row))
    assert cells["model"] == name and cells["steps"] == "3" and cells["size"] == "64x64", row
    identical = cells["bit-identical (md5: output, latents)"]
    assert identical.startswith("yes (`") and "`-`" not in identical, row  # the latents compared too
    assert cells["1st patched call (verifying)"].startswith("kept"), row
    pipe, _ = PIPELINES[name]()
    fp.patch(pipe)
    try:
        patched = [comp for comp in _modules(pipe).values() if STATE_ATTR in comp.__dict__]
        sites = [s for comp in patched for m in comp.modules() for _, s in sites_of(m)]
    finally:
        fp.unpatch(pipe)
    assert len(patched) == (3 if name == "ideogram4" else 2), patched  # the transformer(s) and the VAE
    assert cells["sites"].startswith(f"{len(sites)} ("), (row, len(sites))
    assert int(cells["fast calls"]) > 0, row
