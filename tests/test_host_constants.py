"""`_host_constants.constants_as_fills`: inside a capture, ``torch.tensor(python values, device=...)`` builds the
tensor eager builds (values, dtype, shape) with fill kernels instead of a pageable host copy; everything else is
torch's own ``torch.tensor``, and torch's comes back on leaving, also after an exception and from nested or
concurrent blocks. On a CPU the device type is "cpu" and the capture a predicate (the GPU's is
tests/test_graphs_gpu.py::test_small_host_constants_are_captured_as_fills)."""

from __future__ import annotations

import threading

import pytest
import torch

from diffusers_fastpath import _host_constants
from diffusers_fastpath._host_constants import MAX_ELEMENTS, constants_as_fills

REAL = torch.tensor


class Fills:
    """Counts the fill kernels the replacement launches (``Tensor.fill_`` calls)."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = torch.Tensor.fill_

        def fill_(t, value):
            self.count += 1
            return real(t, value)

        monkeypatch.setattr(torch.Tensor, "fill_", fill_)


@pytest.mark.parametrize("data, kwargs", [
    ([8, 32, 32], {}), ((1, 2, 2), {"dtype": torch.float32}), ([[1.5, -2.25], [3.0, 1e-8]], {}),
    ([0.1, 1 / 3, 7.0], {"dtype": torch.bfloat16}), ([0.1, 65504.0], {"dtype": torch.float16}), (2.5, {}),
    ([True, False], {}), ([1 + 2j, -0.5j], {}), ([], {}), ([[1, 2, 3]], {"dtype": torch.int32}),
    ([0.1, 0.2], {"dtype": torch.float64}), ([2**40, -3], {})], ids=str)
def test_a_small_constant_inside_a_capture_is_the_tensor_eager_builds_made_by_fills(data, kwargs, monkeypatch):
    fills = Fills(monkeypatch)
    ref = REAL(data, device="cpu", **kwargs)
    with constants_as_fills("cpu", capturing=lambda: True):
        got = torch.tensor(data, device="cpu", **kwargs)
    assert got.dtype == ref.dtype and got.shape == ref.shape and got.is_contiguous()
    assert torch.equal(got, ref) and fills.count == ref.numel()
    assert torch.tensor is REAL


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
@pytest.mark.parametrize("case", ["not capturing", "no device", "other device type", "a tensor", "an array",
                                  "requires_grad", "pin_memory", "too many", "positional dtype"])
def test_everything_else_is_torchs_own(case, monkeypatch):
    fills = Fills(monkeypatch)
    data, kwargs, capturing, device_type = [1.0, 2.0, 3.0], {"device": "cpu"}, True, "cpu"
    if case == "not capturing":
        capturing = False
    elif case == "no device":
        kwargs = {}
    elif case == "other device type":
        device_type = "cuda"
    elif case == "a tensor":
        data = REAL([1.0, 2.0])
    elif case == "an array":
        np = pytest.importorskip("numpy")
        data = np.array([1.0, 2.0])
    elif case == "requires_grad":
        kwargs["requires_grad"] = True
    elif case == "pin_memory":
        kwargs["pin_memory"] = True
    elif case == "too many":
        data = list(range(MAX_ELEMENTS + 1))
    calls = []

    def real(*args, **kw):
        calls.append((args, kw))
        kw.pop("pin_memory", None)  # (pinning needs CUDA: what matters here is whose torch.tensor ran)
        return REAL(*args, **kw)

    monkeypatch.setattr(torch, "tensor", real)
    with constants_as_fills(device_type, capturing=lambda: capturing):
        if case == "positional dtype":
            with pytest.raises(TypeError):  # torch's own error, unchanged
                torch.tensor(data, torch.float32)
        else:
            got = torch.tensor(data, **kwargs)
            plain = {k: v for k, v in kwargs.items() if k not in ("requires_grad", "pin_memory")}
            assert torch.equal(got, REAL(data.clone() if isinstance(data, torch.Tensor) else data, **plain))
    assert torch.tensor is real
    assert calls and fills.count == 0, (case, calls, fills.count)


def test_torchs_tensor_comes_back_after_an_exception_and_from_nested_blocks():
    with pytest.raises(ValueError):
        with constants_as_fills("cpu", capturing=lambda: True):
            assert torch.tensor is not REAL
            with constants_as_fills("cpu", capturing=lambda: True):
                pass
            assert torch.tensor is not REAL  # the outer block still holds it
            raise ValueError
    assert torch.tensor is REAL and _host_constants._depth == 0


def test_concurrent_blocks_put_torchs_back_once_the_last_leaves():
    entered, release = threading.Barrier(3), threading.Event()

    def worker():
        with constants_as_fills("cpu", capturing=lambda: True):
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    assert torch.tensor is not REAL
    release.set()
    for t in threads:
        t.join()
    assert torch.tensor is REAL and _host_constants._depth == 0


def test_a_replacement_installed_by_someone_else_is_what_comes_back(monkeypatch):
    def theirs(*args, **kwargs):
        return REAL(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", theirs)
    with constants_as_fills("cpu", capturing=lambda: False):
        assert torch.tensor([1], device="cpu").tolist() == [1]
    assert torch.tensor is theirs


def test_leaving_keeps_a_replacement_someone_installed_meanwhile():
    """Another library (or another thread's ``mock.patch``) installs its own ``torch.tensor`` while a block is active:
    leaving the block keeps theirs."""
    def theirs(*args, **kwargs):
        return REAL(*args, **kwargs)

    block = constants_as_fills("cpu", capturing=lambda: False)
    try:
        block.__enter__()
        torch.tensor = theirs
        block.__exit__(None, None, None)
        assert torch.tensor is theirs and _host_constants._depth == 0
    finally:
        torch.tensor = REAL


def test_a_replacement_kept_and_put_back_by_someone_is_inert_and_dropped_by_the_next_block():
    """The other order: a library saved this package's replacement, installed its own, and puts the replacement back
    after the block left. Kept, it calls torch's own straight through; the next block unwraps it, and leaves torch's
    own behind."""
    block = constants_as_fills("cpu", capturing=lambda: True)
    try:
        block.__enter__()
        found = torch.tensor

        def theirs(*args, **kwargs):
            return found(*args, **kwargs)

        torch.tensor = theirs
        block.__exit__(None, None, None)
        torch.tensor = found  # the library puts back what it found: the replacement
        calls = []
        monkey = _host_constants._tensor_factory(REAL, "cpu", lambda: calls.append(1) or True)
        assert torch.equal(monkey([1.0], device="cpu"), REAL([1.0])) and not calls  # outside any block: inert
        with constants_as_fills("cpu", capturing=lambda: False):
            pass
        assert torch.tensor is REAL
    finally:
        torch.tensor = REAL
