"""`fp.quality` as a stack of requests per model (issue 12, defect 13): contexts that exit out of order, by hand or
from two threads, and on an exception, leave the model at the tier the remaining requests (or the default) say."""

from __future__ import annotations

import threading

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath._state import STATE_ATTR
from diffusers_fastpath.quality import tier_sites
from diffusers_fastpath.testing import build_flux_transformer


def tier(model) -> str:
    return model.__dict__[STATE_ATTR].quality


def mounted(model) -> int:
    return sum(site.mounted for _, _, site in tier_sites(model))


@pytest.fixture
def model(unpatch_after):
    m = build_flux_transformer("flux-tiny", torch.float32, seed=7)
    fp.patch(m)
    unpatch_after(m)
    return m


def test_contexts_exited_out_of_order_by_hand(model):
    sites = len(list(tier_sites(model)))
    assert sites and mounted(model) == 0
    a = fp.quality(model, "high")
    b = fp.quality(model, "high")
    a.__enter__()
    b.__enter__()
    assert tier(model) == "high" and mounted(model) == sites
    a.__exit__(None, None, None)  # b is still active: still high
    assert tier(model) == "high" and mounted(model) == sites
    b.__exit__(None, None, None)
    assert tier(model) == "lossless" and mounted(model) == 0


def test_the_newest_active_request_wins_and_an_inner_exit_out_of_order_restores_it(model):
    outer = fp.quality(model, "lossless")
    inner = fp.quality(model, "high")
    low = fp.quality(model, "lossless")
    inner.__enter__()
    low.__enter__()
    assert tier(model) == "lossless" and mounted(model) == 0
    outer.__enter__()  # newest: lossless
    low.__exit__(None, None, None)
    assert tier(model) == "lossless"
    outer.__exit__(None, None, None)  # only the high request is left
    assert tier(model) == "high" and mounted(model) > 0
    inner.__exit__(None, None, None)
    assert tier(model) == "lossless" and mounted(model) == 0


def test_two_threads_exiting_in_the_order_entered(model):
    """Thread A enters, thread B enters, A exits, B exits (forced by events): the model ends lossless. With one
    saved value per context B would restore the "high" it saw on entry."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str] = {}
    errors: list[BaseException] = []

    def thread_a():
        try:
            with fp.quality(model, "high"):
                a_in.set()
                assert b_in.wait(30)
            seen["a_after"] = tier(model)  # B is still inside
            a_out.set()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            a_out.set()

    def thread_b():
        try:
            assert a_in.wait(30)
            with fp.quality(model, "high"):
                b_in.set()
                assert a_out.wait(30)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            b_in.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert seen["a_after"] == "high"
    assert tier(model) == "lossless" and mounted(model) == 0


def test_an_exception_inside_a_block_that_outlived_an_earlier_one(model):
    """``a`` (high) enters, ``b`` (lossless) enters, ``a`` exits first, then ``b`` exits by an exception: nothing is
    left but the default. With one saved value per context ``b`` would restore the "high" it saw on entry."""
    a = fp.quality(model, "high")
    a.__enter__()
    with pytest.raises(RuntimeError, match="boom"):
        with fp.quality(model, "lossless"):
            assert tier(model) == "lossless"
            a.__exit__(None, None, None)
            assert tier(model) == "lossless" and mounted(model) == 0
            raise RuntimeError("boom")
    assert tier(model) == "lossless" and mounted(model) == 0


def test_an_exception_inside_the_block_removes_its_request(model):
    keep = fp.quality(model, "high")
    keep.__enter__()
    with pytest.raises(RuntimeError, match="boom"):
        with fp.quality(model, "lossless"):
            assert tier(model) == "lossless" and mounted(model) == 0
            raise RuntimeError("boom")
    assert tier(model) == "high" and mounted(model) > 0
    keep.__exit__(None, None, None)
    assert tier(model) == "lossless" and mounted(model) == 0


def test_repatching_changes_the_default_under_active_requests(model):
    ctx = fp.quality(model, "lossless")
    ctx.__enter__()
    fp.patch(model, quality="high")  # the default changes; the active request still decides
    assert tier(model) == "lossless" and mounted(model) == 0
    ctx.__exit__(None, None, None)
    assert tier(model) == "high" and mounted(model) > 0
    assert fp.report(model).models[0].quality == "high"
    fp.patch(model, quality="lossless")
    assert tier(model) == "lossless" and mounted(model) == 0

