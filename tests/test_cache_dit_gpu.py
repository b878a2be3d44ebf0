"""cache-dit with ``patch(..., cuda_graphs=True)`` on the GPU (issue 43, item 10): for tiny FLUX.1, Wan 2.1 and
Qwen-Image, in bfloat16, cache-dit alone against patch with graphs and cache-dit in either order, undone in either
order: `torch.equal` latents, nothing captured while cache-dit's forward is in place (on ed203a0 the capture's
warm-up and checking replay advanced cache-dit's steps on Wan, raised a size mismatch on Qwen-Image, and
``disable_cache`` raised ``'GraphForward' object has no attribute '__get__'``), `report` saying why, the pipeline
left as cache-dit alone leaves it; where ``disable_cache`` gives the graphs their forward back, real graphs replay
and equal unpatched eager. The CPU cells (the simulated backend) are in `test_cache_dit.py`, whose helpers these use.
"""

from __future__ import annotations

import pytest
import torch

import diffusers_fastpath as fp
from test_cache_dit import BUILDERS, cache_dit, cache_off_after, check_every_order, generate, references  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def alone_on_gpu():
    return references("cuda", DTYPE)


@pytest.mark.parametrize("family", BUILDERS)
def test_the_cache_changes_the_numbers_on_the_gpu(family, alone_on_gpu):
    plain, cached, _ = alone_on_gpu(family)
    assert plain.is_cuda and not torch.equal(plain, cached)


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("first", ["patch_first", "cache_first"])
@pytest.mark.parametrize("undo", ["unpatch_first", "disable_first"])
def test_cuda_graphs_and_cache_dit_in_every_order(family, first, undo, alone_on_gpu, cache_off_after):
    pipe = BUILDERS[family]("cuda", DTYPE)
    cache_off_after(pipe)
    runner = check_every_order(pipe, family, first, undo, alone_on_gpu(family),
                               lambda: fp.patch(pipe, cuda_graphs=True))
    assert runner is not None
    if (first, undo) == ("patch_first", "disable_first") and family != "flux":
        assert runner.captures >= 1 and runner.replays > 0 and not runner.failed, runner.stats()  # real graphs


@pytest.mark.parametrize("family", ["wan", "qwenimage"])
def test_graphs_capture_over_what_disable_cache_leaves(family, alone_on_gpu, unpatch_after):
    """After cache-dit came and went, the instance dict holds the class's forward, bound (wraps nothing): graphs
    go on over it, replay, and unpatch puts it back. (FLUX keeps cache-dit's functor forward: graphs stay off.)"""
    plain, _, _ = alone_on_gpu(family)
    pipe = BUILDERS[family]("cuda", DTYPE)
    cache_dit.enable_cache(pipe)
    cache_dit.disable_cache(pipe)
    left = vars(pipe.transformer)["forward"]
    fp.patch(pipe, cuda_graphs=True)
    unpatch_after(pipe)
    for _ in range(2):
        assert torch.equal(generate(pipe, family), plain)
    stats = next(m for m in fp.report(pipe).models if m.name == "transformer").graphs  # (the VAE: patched too)
    assert stats["status"] == "on" and stats["captured"] >= 1 and stats["replays"] > 0, stats
    fp.unpatch(pipe)
    assert vars(pipe.transformer)["forward"] == left
