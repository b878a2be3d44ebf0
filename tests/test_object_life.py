"""A patched model through `copy.deepcopy`, `pickle` and `torch.save`/`torch.load` (issue 12, defects 4 and 5): a
copy is patched on its own (its own undo log, sites and counters; each unpatches alone), a pickled model loads
patched and ``torch.equal`` to unpatched diffusers, and `unpatch` of the loaded model restores diffusers' classes.
The CUDA-graphs runner drops its CUDA state on a copy and captures again on demand."""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import diffusers_fastpath as fp
from diffusers_fastpath import graphs
from diffusers_fastpath._state import STATE_ATTR, sites_of
from diffusers_fastpath.graphs import GRAPHS_ATTR
from diffusers_fastpath.quality import tier_sites
from diffusers_fastpath.testing import (
    build_ernie_image_transformer,
    build_flux2_transformer,
    build_flux_transformer,
    ernie_image_inputs,
    flux2_transformer_inputs,
    flux_transformer_inputs,
)

FAMILIES = {
    "flux": (build_flux_transformer, flux_transformer_inputs),  # hand-mirrored forwards
    "ernie-image": (build_ernie_image_transformer, ernie_image_inputs),
    "flux2": (build_flux2_transformer, flux2_transformer_inputs),  # forwards rewritten by `_chains.fused_subclass`
}


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.sample if hasattr(out, "sample") else out[0]


def layout(model):
    """What patch/unpatch change: module classes, processor classes, instance attributes of this package."""
    return [
        (name, type(m), type(getattr(m, "processor", None)), sorted(k for k in vars(m) if k.startswith("_fastpath")))
        for name, m in model.named_modules()
    ]


def all_sites(model):
    found = [site for m in model.modules() for _, site in sites_of(m)]
    found += [site for _, _, site in tier_sites(model)]
    return found


def counts(model):
    return [(s.fast, sum(s.fallback.values())) for s in all_sites(model) if hasattr(s, "fast")]


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    """(patched model, unpatched twin, fresh inputs, the twin's layout) of one family, patched after one forward."""
    build, make_inputs = FAMILIES[request.param]
    seed = fresh_seed()
    model, twin = build(dtype=torch.float32, seed=seed), build(dtype=torch.float32, seed=seed)
    unpatched = layout(twin)
    fp.patch(model)
    inputs = make_inputs(model, seed=seed + 1)
    assert torch.equal(run(model, inputs), run(twin, inputs))
    yield model, twin, inputs, unpatched
    fp.unpatch(model)


# --- copy.deepcopy --------------------------------------------------------------------------------------------


def test_a_deepcopy_is_patched_on_its_own(family):
    model, twin, inputs, unpatched = family
    patched = layout(model)
    clone = copy.deepcopy(model)
    assert layout(clone) == patched
    assert not {id(s) for s in all_sites(model)} & {id(s) for s in all_sites(clone)}  # its own counters

    before = counts(model)
    assert torch.equal(run(clone, inputs), run(twin, inputs))
    assert counts(model) == before and counts(clone) != before  # the copy counts on its own sites

    fp.unpatch(clone)
    assert layout(clone) == unpatched and STATE_ATTR not in vars(clone)
    assert layout(model) == patched  # the original stays patched
    assert torch.equal(run(clone, inputs), run(twin, inputs)) and torch.equal(run(model, inputs), run(twin, inputs))
    fp.unpatch(model)
    assert layout(model) == unpatched


def test_a_deepcopy_maps_every_record_of_the_undo_log_onto_the_copy(family):
    model = family[0]
    clone = copy.deepcopy(model)
    state, clone_state = model.__dict__[STATE_ATTR], clone.__dict__[STATE_ATTR]
    assert clone_state is not state and len(clone_state.records) == len(state.records)
    mine, theirs = {id(m) for m in model.modules()}, {id(m) for m in clone.modules()}
    for record in clone_state.records:
        named = [x for x in record[1:] if isinstance(x, torch.nn.Module)]
        assert all(id(x) in theirs and id(x) not in mine for x in named), record
    fp.unpatch(clone)


# --- two models sharing modules (issue 43, item 12) -------------------------------------------------------------


def _leftovers(*models):
    """Attributes of this package and classes of this package still on the modules of `models`."""
    found = set()
    for model in models:
        for name, m in model.named_modules():
            found |= {(name, k) for k in vars(m) if k.startswith("_fastpath")}
            if type(m).__module__.startswith("diffusers_fastpath"):
                found.add((name, type(m).__name__))
    return found


@pytest.mark.parametrize("first_undone", ["A", "B"])
@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_two_models_sharing_blocks_unpatch_in_any_order_and_leave_nothing(family_name, first_undone,
                                                                         emulated_kernels):
    """A and B share their blocks (B's patch finds A's attributes on them and sets its own over them): patch A,
    patch B, then unpatch either first. Every model computes what it computes unpatched at every stage, and once
    both are unpatched no attribute and no class of this package is left on any module."""
    build, make_inputs = FAMILIES[family_name]
    seed = fresh_seed()
    a, b = build(dtype=torch.float32, seed=seed), build(dtype=torch.float32, seed=seed + 1)
    for attr in ("transformer_blocks", "single_transformer_blocks", "layers"):
        if hasattr(a, attr):
            setattr(b, attr, getattr(a, attr))
    inputs = make_inputs(a, seed=seed + 2)
    refs = {"A": run(a, inputs), "B": run(b, inputs)}
    assert not torch.equal(refs["A"], refs["B"])  # B has weights of its own outside the shared blocks
    models = {"A": a, "B": b}

    def exact():
        return all(torch.equal(run(models[k], inputs), refs[k]) for k in models)

    fp.patch(a)
    fp.patch(b)
    assert exact()
    fp.unpatch(models[first_undone])
    assert exact()
    fp.unpatch(models["B" if first_undone == "A" else "A"])
    assert exact()
    assert _leftovers(a, b) == set()


def test_an_attribute_set_by_two_patches_shows_the_newest_left_and_then_the_original():
    """The layers of one attribute (`_state.LAYERS_ATTR`): undoing the older patch first keeps the newer value;
    undoing the newer one then puts back the original, a value the module had before either patch."""
    from diffusers_fastpath._state import LAYERS_ATTR, PatchState

    module = torch.nn.Linear(2, 2)
    module.__dict__["_fastpath_x"] = "original"
    first, second = PatchState("lossless"), PatchState("lossless")
    first.set_attr(module, "_fastpath_x", "first")
    second.set_attr(module, "_fastpath_x", "second")
    first.undo()
    assert module._fastpath_x == "second"
    second.undo()
    assert module._fastpath_x == "original" and LAYERS_ATTR not in vars(module)
    first.set_attr(module, "_fastpath_y", 1)
    clone = copy.deepcopy((module, first))  # the layers and the record travel together
    first.undo()
    assert "_fastpath_y" not in vars(module) and clone[0]._fastpath_y == 1
    clone[1].undo()
    assert "_fastpath_y" not in vars(clone[0]) and LAYERS_ATTR not in vars(clone[0])


# --- pickle / torch.save ----------------------------------------------------------------------------------------


def _pickle(model):
    return pickle.loads(pickle.dumps(model))


def _torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("roundtrip", [_pickle, _torch_save], ids=["pickle", "torch.save"])
def test_a_pickled_model_loads_patched_and_unpatches(family, roundtrip):
    model, twin, inputs, unpatched = family
    loaded = roundtrip(model)
    assert layout(loaded) == layout(model) and STATE_ATTR in vars(loaded)
    assert torch.equal(run(loaded, inputs), run(twin, inputs))
    assert fp.report(loaded).models[0].quality == "lossless"
    assert len(list(tier_sites(loaded))) == len(list(tier_sites(model)))
    with fp.quality(loaded, "high"):  # its tier sites are live (FLUX has some, ERNIE-Image none)
        assert all(site.mounted for _, _, site in tier_sites(loaded) if site.cannot is None)
    fp.unpatch(loaded)
    assert layout(loaded) == unpatched
    assert all(type(m).__module__.startswith(("diffusers.", "torch.")) for m in loaded.modules())
    assert torch.equal(run(loaded, inputs), run(twin, inputs))
    assert layout(model) != unpatched  # the original is untouched


def test_a_model_pickled_at_high_inside_a_context_loads_at_high_as_its_default(unpatch_after):
    model = build_flux_transformer("flux-tiny", torch.float32, seed=fresh_seed())
    fp.patch(model)
    unpatch_after(model)
    with fp.quality(model, "high"):
        loaded = _pickle(model)
    state = loaded.__dict__[STATE_ATTR]
    assert state.quality == state.default_quality == "high"  # no context governs the copy
    assert all(site.mounted for _, _, site in tier_sites(loaded) if site.cannot is None)
    fp.unpatch(loaded)


@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_a_model_saved_patched_loads_in_a_fresh_process_with_diffusers_registries(tmp_path, family):
    """A fresh process knows nothing of our block classes in diffusers' registries: loading the model registers them
    again (enable_cache finds the blocks), and unpatch there restores diffusers' classes. FLUX.2's block classes are
    rewritten ones (`_chains.fused_subclass`): the loading process finds them by name in the adapter module."""
    build, make_inputs = FAMILIES[family]
    seed = fresh_seed()
    model = build(dtype=torch.float32, seed=seed)
    fp.patch(model)
    if family == "flux2":  # its blocks are rewritten subclasses (`_chains.fused_subclass`)
        assert type(model.transformer_blocks[0]).__module__ == "diffusers_fastpath.models.flux2"
    inputs = make_inputs(model, seed=seed + 1)
    torch.save({"model": model, "inputs": inputs}, tmp_path / "patched.pt")
    fp.unpatch(model)
    # The unpatched reference is built there (same seed), under that process's settings.
    script = f"""
import torch
import diffusers_fastpath as fp
from diffusers.hooks import FirstBlockCacheConfig
from diffusers_fastpath.testing import {build.__name__} as build
saved = torch.load({str(tmp_path / 'patched.pt')!r}, weights_only=False)
model, inputs = saved["model"], saved["inputs"]
twin = build(dtype=torch.float32, seed={seed})
from diffusers.hooks._helpers import TransformerBlockRegistry
TransformerBlockRegistry.get(type(model.transformer_blocks[0]))  # registered again on loading
with torch.no_grad():
    expected = twin(**inputs).sample
    assert torch.equal(model(**inputs).sample, expected)
    if {family == "flux"}:  # (diffusers' first-block cache does not run FLUX.2, patched or not)
        model.enable_cache(FirstBlockCacheConfig(threshold=0.0))
        with model.cache_context("cond"):
            assert torch.equal(model(**inputs).sample, expected)
        model.disable_cache()
fp.unpatch(model)
assert all(type(m).__module__.startswith(("diffusers.", "torch.")) for m in model.modules())
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# --- the CUDA-graphs runner -------------------------------------------------------------------------------------


class Replay:
    """A simulated graph (see test_graphs.SimulatedGraphs): a replay runs the forward on the static inputs and
    writes into the static outputs."""

    def __init__(self, fn, out) -> None:
        self.fn, self.out = fn, out

    def replay(self):
        for static, new in zip(pytree.tree_leaves(self.out), pytree.tree_leaves(self.fn())):
            static.copy_(new)


class PicklableSimulatedGraphs:
    """A module-level CPU stand-in for `graphs.CudaGraphs` (so that it pickles with the runner)."""

    device_type = "cpu"

    def __init__(self) -> None:
        self.pools = 0

    def new_pool(self, device):
        self.pools += 1
        return ("pool", self.pools)

    def record(self, pool, fn):
        out = fn()
        return Replay(fn, out), out

    def pool_bytes(self, pool):
        return 0


@pytest.mark.parametrize("roundtrip", [copy.deepcopy, _pickle, _torch_save], ids=["deepcopy", "pickle", "torch.save"])
def test_graphs_drop_their_cuda_state_on_a_copy_and_capture_again(roundtrip, unpatch_after):
    seed = fresh_seed()
    model = build_flux_transformer("flux-tiny", torch.float32, seed=seed)
    twin = build_flux_transformer("flux-tiny", torch.float32, seed=seed)
    fp.patch(model)
    unpatch_after(model)
    runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", PicklableSimulatedGraphs())
    inputs = flux_transformer_inputs(model, seed=seed + 1)
    run(model, inputs)
    run(model, inputs)
    assert runner.replays == 1 and len(runner.graphs) == 1

    clone = roundtrip(model)
    clone_runner = clone.__dict__[GRAPHS_ATTR]
    assert clone_runner is not runner and clone_runner.state is clone.__dict__[STATE_ATTR]
    assert clone_runner.graphs == {} and clone_runner.fingerprint is None and clone_runner.pool is None
    forward = clone.__dict__["forward"]
    assert forward.runner is clone_runner and forward.model_ref() is clone
    import inspect

    assert inspect.signature(clone.forward) == inspect.signature(type(clone).forward.__get__(clone))

    expected = run(twin, inputs)
    assert torch.equal(run(clone, inputs), expected)  # captured again, for the copy's own modules
    assert torch.equal(run(clone, inputs), expected)
    assert len(clone_runner.graphs) == 1 and clone_runner.replays == runner.replays + 1
    assert runner.replays == 1 and len(runner.graphs) == 1  # the original's runner did not move
    assert all(m in set(clone.modules()) for m in clone_runner.fingerprint.modules)

    fp.unpatch(clone)
    assert "forward" not in vars(clone) and GRAPHS_ATTR not in vars(clone)
    assert "forward" in vars(model) and torch.equal(run(model, inputs), expected)
