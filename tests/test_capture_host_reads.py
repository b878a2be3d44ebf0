"""Forwards that read their inputs on the host, made capturable (issue 40): Bria FIBO 2's text lengths as its graph
key, its ``.tolist()`` answered from the key while a graph records (`diffusers_fastpath._host_reads`), boolean
key-padding masks made additive on the device while a graph records; Ideogram 4 (its cuDNN additive mask's zero on
the device: tests/test_attention_bool_mask.py). On the CPU the runner's logic is simulated (`SimulatedGraphs`); the
GPU tests capture for real and compare every replay with unpatched eager by ``torch.equal``."""

from __future__ import annotations

import inspect

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath import _host_ops, _host_reads, graphs
from diffusers_fastpath.models import bria_fibo2
from diffusers_fastpath.testing import zoo
from diffusers_fastpath.testing.capture_pass import CapturePassGraphs, HostTransfers


def _fibo2(device="cpu", dtype=torch.float32, seed=3):
    return zoo.build("bria-fibo2", dtype=dtype, device=device, seed=seed)


def _other_lengths(inputs: dict, row: int = 1, drop: int = 2) -> dict:
    """The same shapes, other text lengths (row `row` loses its last `drop` tokens)."""
    mask = inputs["encoder_attention_mask"].clone()
    mask[row, -drop:] = False
    return dict(inputs, encoder_attention_mask=mask)


def _simulated(model):
    from diffusers_fastpath._state import STATE_ATTR
    from diffusers_fastpath.testing import SimulatedGraphs

    fp.patch(model)
    return graphs.install(model, model.__dict__[STATE_ATTR], "transformer", SimulatedGraphs())


def test_fibo2_forward_reads_only_its_text_lengths_and_registers_the_key():
    from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel

    assert bria_fibo2._reads_only_text_lengths(BriaFibo2Transformer2DModel.forward)
    assert graphs.HOST_KEYS[BriaFibo2Transformer2DModel] is bria_fibo2.text_lengths
    assert any(module is torch.Tensor and name == "tolist"
               for module, name, *_ in graphs.CAPTURE_TWINS[BriaFibo2Transformer2DModel])
    assert not bria_fibo2._reads_only_text_lengths(lambda mask: mask.sum(dim=1).tolist() + mask.tolist())


def test_fibo2_key_is_the_text_lengths():
    model = _fibo2()
    a = zoo.inputs("bria-fibo2", model, batch=2)
    key_a, side_a = bria_fibo2.text_lengths(model, a)
    key_b, _ = bria_fibo2.text_lengths(model, _other_lengths(a))
    want = tuple(a["encoder_attention_mask"].sum(dim=1).tolist())
    assert key_a == ("text lengths", want) and key_b != key_a and side_a().values == [list(want)]
    assert bria_fibo2.text_lengths(model, dict(a, encoder_attention_mask=None))[0] == ()
    float_mask = dict(a, encoder_attention_mask=a["encoder_attention_mask"].float())
    assert bria_fibo2.text_lengths(model, float_mask) == (None, None)  # sums of a float mask: not keyed


def test_fibo2_graphs_key_on_text_lengths_and_record_without_host_reads(unpatch_after, monkeypatch):
    """Simulated on the CPU: two sets of text lengths of the same shapes record two graphs, each replayed for its own
    lengths only, equal to unpatched eager; while a graph records, the forward's ``.tolist()`` is the twin's."""
    model, twin = _fibo2(), _fibo2()
    runner = _simulated(model)
    unpatch_after(model)
    answered = []
    real = _host_reads.HostReads.answer

    def spy(self, tensor, capturing):
        answered.append(tuple(tensor.shape))
        return real(self, tensor, capturing)

    monkeypatch.setattr(_host_reads.HostReads, "answer", spy)
    a = zoo.inputs("bria-fibo2", model, batch=2)
    b = _other_lengths(a)
    assert bria_fibo2.text_lengths(model, a)[0] != bria_fibo2.text_lengths(model, b)[0]
    with torch.no_grad():
        for inputs in (a, b, a, b):
            assert torch.equal(model(**inputs)[0], twin(**inputs)[0])
    assert runner.captures == 2 and runner.replays == 2 and len(runner.graphs) == 2, (runner.eager, runner.failed)
    assert len({sig[2] for sig in runner.graphs}) == 2  # keyed on the two sets of lengths
    assert answered == [(2,), (2,)]  # one read per recording, answered by the key
    assert torch.Tensor.tolist is _host_reads._TOLIST and "tolist" not in vars(torch.Tensor)  # put back


def test_fibo2_a_read_the_key_does_not_hold_fails_the_capture_and_runs_eager(unpatch_after, monkeypatch):
    """A key whose values are not what the forward reads (or that misses a read): the recording raises, the call's
    result is eager's, and the reason is counted; later calls of that signature run eager."""
    model, twin = _fibo2(), _fibo2()
    runner = _simulated(model)
    unpatch_after(model)
    from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel

    def wrong(model, call):
        key, _ = bria_fibo2.text_lengths(model, call)
        return key, lambda: _host_reads.HostReads([[1, 1]])

    monkeypatch.setitem(graphs.HOST_KEYS, BriaFibo2Transformer2DModel, wrong)
    a = zoo.inputs("bria-fibo2", model, batch=2)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(**a)[0], twin(**a)[0])
    assert not runner.graphs and len(runner.failed) == 1, runner.failed
    reason = next(iter(runner.failed.values()))
    assert "not the graph key's" in reason, reason
    assert sum(runner.eager.values()) == 1

    def short(model, call):
        key, _ = bria_fibo2.text_lengths(model, call)
        return ("other",) + key, lambda: _host_reads.HostReads([])

    monkeypatch.setitem(graphs.HOST_KEYS, BriaFibo2Transformer2DModel, short)
    with torch.no_grad():
        assert torch.equal(model(**a)[0], twin(**a)[0])
    assert any("does not hold" in r for r in runner.failed.values()), runner.failed


def test_tolist_twin_is_torch_own_outside_a_host_read_recording():
    t = torch.arange(3)
    assert _host_reads.tolist_twin(t) == [0, 1, 2]  # no recording
    with graphs._side_bound(lambda: ("lumina-style side",)):
        assert _host_reads.tolist_twin(t) == [0, 1, 2]  # a side that is not HostReads
    reads = _host_reads.HostReads([[0, 1, 2]])
    with graphs._side_bound(lambda: reads):
        assert graphs.recording()
        assert _host_reads.tolist_twin(t) == [0, 1, 2]
        with pytest.raises(RuntimeError, match="does not hold"):
            _host_reads.tolist_twin(t)
    assert not graphs.recording()
    inside = _host_reads.HostReads([[7]])
    assert inside.answer(torch.arange(1), capturing=True) == [7]  # in the capture: the key's value, no read


def test_key_padding_masks_take_the_bool_mask_op_only_while_recording(monkeypatch):
    """Outside a recording a key-padding mask ``[B, 1, 1, S]`` runs as written (host cost); while a graph records it
    goes to the op, whose additive mask is made on the device (torch's cuDNN conversion copies a host zero)."""
    from diffusers_fastpath.models import _chain_calls

    taken = []
    monkeypatch.setattr(_chain_calls, "attention_bool_mask", lambda *a, **k: taken.append(1) or "op")
    ns = _chain_calls._ChainsNamespace
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    dispatch = lambda q, k, v, **kw: "written"  # noqa: E731
    assert ns.attention_bool_mask(dispatch, 1, 2, 3, None, attn_mask=mask) == "written"
    with graphs._side_bound(None):
        assert ns.attention_bool_mask(dispatch, 1, 2, 3, None, attn_mask=mask) == "op"
        assert ns.attention_bool_mask(dispatch, 1, 2, 3, None, attn_mask=mask.float()) == "written"
    assert taken == [1]


def _own_forward(cls):
    """A subclass of `cls` whose ``forward`` is its own (it calls the parent's: the same host reads, unchecked)."""
    def forward(self, **kwargs):
        return super(sub, self).forward(**kwargs)

    params = list(inspect.signature(cls.forward).parameters.values())
    forward.__signature__ = inspect.Signature(params)  # (named arguments, as the graph runner takes them)
    sub = type(f"OwnForward{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return sub


def test_host_key_and_ops_registrations_stand_for_the_forward_they_were_made_for(monkeypatch):
    """`HOST_KEYS` / `HOST_OPS` apply where the model's class runs the forward they were registered for: the class
    and a subclass that keeps its forward; not a subclass with a forward of its own, nor the class once its forward
    was replaced (nobody read those forwards' host reads)."""
    from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel as Bria
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel as Qwen

    fibo2, qwen = _fibo2(), zoo.build("qwen-image-21", dtype=torch.float32)
    inherits = type("InheritsBria", (Bria,), {"__module__": __name__})
    for model, cls in ((fibo2, Bria), (qwen, Qwen)):
        assert graphs.registered(graphs.HOST_KEYS, model) is graphs.HOST_KEYS[cls]
        model.__class__ = _own_forward(cls)
        assert graphs.registered(graphs.HOST_KEYS, model) is None and graphs.registered(graphs.HOST_OPS, model) is None
        model.__class__ = cls
    assert graphs.registered(graphs.HOST_OPS, qwen) == ("transformer_qwenimage21.py",)
    fibo2.__class__ = inherits
    assert graphs.registered(graphs.HOST_KEYS, fibo2) is bria_fibo2.text_lengths
    fibo2.__class__ = Bria
    a = zoo.inputs("bria-fibo2", fibo2, batch=2)
    names = tuple(inspect.signature(Bria.forward).parameters)[1:]
    assert graphs._host_key(fibo2, names, (), a)[0] == bria_fibo2.text_lengths(fibo2, a)[0]
    monkeypatch.setattr(Bria, "forward", _own_forward(Bria).forward)  # the class's forward replaced after
    assert graphs._host_key(fibo2, names, (), a) is None and graphs.registered(graphs.HOST_KEYS, fibo2) is None
    monkeypatch.setattr(Qwen, "forward", _own_forward(Qwen).forward)
    with pytest.raises(ValueError, match="another forward"):  # host ops for a forward its key was not made for
        graphs.register_host_ops(Qwen, ("transformer_qwenimage21.py",))


def test_a_subclass_with_its_own_forward_records_without_the_host_key():
    """Bria FIBO 2's subclass with a forward of its own (the same ``.tolist()`` through ``super()``): no host key
    answers its read, so its imitated capture reads the device, fails, and that signature runs eager, equal to eager
    (with the key inherited, the read would be answered and the graph kept for a forward nobody checked)."""
    from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel as Bria

    from diffusers_fastpath._state import STATE_ATTR

    model, twin = _fibo2(), _fibo2()
    model.__class__ = _own_forward(Bria)
    fp.patch(model)
    try:
        backend = CapturePassGraphs(strict=True)
        runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", backend)
        a = zoo.inputs("bria-fibo2", model, batch=2, seed=6)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(**a)[0], twin(**a)[0])
        assert runner.captures == 1 and not runner.graphs and len(runner.failed) == 1, (runner.graphs, runner.eager)
        assert "tolist of a device tensor (a read)" in next(iter(runner.failed.values())), runner.failed
    finally:
        fp.unpatch(model)


def _toy(x, mask, values):
    """Every kind of call `_host_ops` answers, made from this file (as a model's module would)."""
    repeats = mask.long() + 1
    slots = torch.repeat_interleave(mask, repeats)  # a tensor of repeats: the output size is their sum
    y = x.repeat_interleave(repeats, dim=0)
    y[slots] = 0.5  # boolean scatter
    picked = y[~slots]  # boolean gather
    n = int(mask.sum())
    where = mask.nonzero(as_tuple=True)[0]
    table = torch.tensor(list(range(70)), dtype=torch.long, device=x.device)  # > MAX_ELEMENTS values
    return picked.tolist(), n, where.tolist(), table[:n].tolist(), values.tolist()


def test_host_ops_answer_each_kind_from_the_warm_up_and_read_nothing_in_the_capture():
    x, mask, values = torch.arange(4.0), torch.tensor([True, False, True, False]), torch.tensor([3, 4])
    ops = _host_ops.HostOps()
    files = ("test_capture_host_reads.py",)
    with _host_ops.replayed(ops, files, "cpu", capturing=lambda: False):
        warm = _toy(x, mask, values)
    assert warm == _toy(x, mask, values)  # the warm-up is the call as written
    assert [k for k, _, _ in ops.entries] == ["repeat", "repeat", "index", "index", "value", "nonzero", "tensor",
                                               "value", "value", "value", "value"], ops.entries
    # the capture pass reads nothing: other values of the same shapes get the warm-up's answers (what a graph keyed
    # on those values never sees: here only to show that nothing was read)
    other_mask, other_values = torch.tensor([False, True, True, False]), torch.tensor([9, 9])
    with _host_ops.replayed(ops, files, "cpu", capturing=lambda: True):
        answered = _toy(x, other_mask, other_values)
    assert answered == warm != _toy(x, other_mask, other_values)
    with _host_ops.replayed(ops, files, "cpu", capturing=lambda: True):
        _toy(x, mask, values)
        with pytest.raises(RuntimeError, match="did not"):
            int(mask.sum())  # one call more than the warm-up made
    with _host_ops.replayed(ops, files, "cpu", capturing=lambda: True), pytest.raises(RuntimeError, match="is not"):
        mask.nonzero(as_tuple=True)  # another call than the warm-up's first
    elsewhere = _host_ops.HostOps()
    with _host_ops.replayed(elsewhere, ("another_module.py",), "cpu", capturing=lambda: False):
        _toy(x, mask, values)
    assert elsewhere.entries == []  # calls from other files go to torch as made


def test_qwen21_key_is_the_image_slot_mask_and_registered_for_its_module():
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel

    from diffusers_fastpath.models import qwenimage21

    assert qwenimage21._module_digest() == qwenimage21._MODULE
    assert graphs.HOST_KEYS[QwenImage21Transformer2DModel] is qwenimage21.image_slots
    assert graphs.HOST_OPS[QwenImage21Transformer2DModel] == ("transformer_qwenimage21.py",)
    model = zoo.build("qwen-image-21", dtype=torch.float32)
    a = zoo.inputs("qwen-image-21", model, batch=2)
    key, side = qwenimage21.image_slots(model, a)
    other = a["img_mask"].clone()
    other[:, 0] = True  # one text slot made an image slot: another layout, the same shape
    assert key[0] == "img_mask" and side is None and qwenimage21.image_slots(model, dict(a, img_mask=other))[0] != key
    assert qwenimage21.image_slots(model, dict(a, img_mask=a["img_mask"].long())) == (None, None)


def _imitated(name, calls, backend):
    """`calls` of a patched `name` recorded by `backend` (`CapturePassGraphs`), each compared with unpatched eager."""
    from diffusers_fastpath._state import STATE_ATTR

    model, twin = zoo.build(name, dtype=torch.float32), zoo.build(name, dtype=torch.float32)
    fp.patch(model)
    try:
        runner = graphs.install(model, model.__dict__[STATE_ATTR], "transformer", backend)
        runner.refs = []
        with torch.no_grad():
            for inputs in calls(model):
                runner.refs.append(twin(**inputs)[0])
                assert torch.equal(model(**inputs)[0], runner.refs[-1])
        runner.kept = [g.keep for g in runner.graphs.values()]  # (unpatch drops the graphs)
        runner.keys = [sig[2] for sig in runner.graphs]
    finally:
        fp.unpatch(model)
    return runner


def _qwen21_calls(batch):
    def calls(model):
        a = zoo.inputs("qwen-image-21", model, batch=batch, seed=6)
        return [a, dict(a, hidden_states=torch.randn_like(a["hidden_states"]), timestep=a["timestep"] * 0.5), a]
    return calls


@pytest.mark.parametrize("batch", [1, 2])
def test_qwen21_graphs_record_answered_and_replay_equal_eager(batch):
    """Recorded as a CUDA graph is (a warm-up, then a capture pass answered from it, with `_host_constants`' fills),
    the forward equals unpatched eager, and so do replays of new latents and timesteps; the calls answered are the
    forward's data-dependent ones, and its capture pass copies nothing from the host and reads nothing back."""
    backend = CapturePassGraphs(strict=True)
    runner = _imitated("qwen-image-21", _qwen21_calls(batch), backend)
    assert runner.captures == 1 and runner.replays == 2 and len(runner.kept) == 1 and not runner.eager, runner.eager
    assert backend.transfers == []
    kinds = [k for k, _, _ in runner.kept[0].entries]
    assert {"repeat", "index", "nonzero", "value"} <= set(kinds), kinds


def test_qwen21_capture_pass_catches_the_host_scalar_scatter(monkeypatch):
    """What the H100 refused at 9dcad12 (``target_token_mask[image_positions[-n:]] = True``: torch copies a host
    scalar over) is caught on the CPU: with the number handed to torch as written, the imitated capture fails there
    and that signature runs eager, equal to eager."""
    monkeypatch.setattr(_host_ops, "_number", lambda value: False)  # (the scatter of a number as 9dcad12 made it)
    backend = CapturePassGraphs(strict=True)
    runner = _imitated("qwen-image-21", _qwen21_calls(1), backend)
    assert not runner.kept and len(runner.eager) == 1, runner.eager  # (unpatch clears `failed`; `eager` stays)
    where = {w for _, w in backend.transfers}
    assert where == {"transformers/transformer_qwenimage21.py:859"}, backend.transfers
    assert "x[indices] = number" in next(iter(runner.eager))


def _qwen21_condition(model, slot: int | None, batch: int = 2, seed: int = 6) -> dict:
    """Qwen-Image 2.1's inputs with a 2x2-token condition image whose one slot is slot `slot` of the prompt (the
    pipeline's ``<|vision_start|><|image_pad|><|vision_end|>`` in the text: its text positions interleave with the
    image's), the target's slots last; `slot` None: the zoo's (text, then the target). The same shapes for every
    `slot`: only ``img_mask``'s values (the key) differ."""
    a = zoo.inputs("qwen-image-21", model, batch=batch, seed=seed)
    if slot is None:
        return a
    mask = a["img_mask"].clone()
    mask[:, slot] = True
    g = torch.Generator().manual_seed(seed)
    condition = torch.randn(batch, 4, a["hidden_states"].shape[2], generator=g).to(a["hidden_states"])
    return dict(a, hidden_states=torch.cat([condition, a["hidden_states"]], dim=1), img_mask=mask,
                img_shapes=[[(1, 2, 2), *a["img_shapes"][0]]] * batch)


@pytest.mark.parametrize("slot", [None, 2], ids=["text-then-target", "condition-in-text"])
def test_qwen21_graph_replays_other_text_masks_equal_eager(slot):
    """``encoder_hidden_states_mask`` is not in Qwen-Image 2.1's key: its values reach the attention masks by device
    ops alone (a gather by the warm-up's indices, an ``index_put_``). So the graph recorded for one text mask replays
    others of its shape, each equal to unpatched eager with that mask. Replayed traced: no Python, every value the
    capture pass took on the host baked in, as in a CUDA graph (a mask value baked in gives the recording's number)."""
    def calls(model):
        a = _qwen21_condition(model, slot)
        mask = a["encoder_hidden_states_mask"]
        padded_1, unpadded_0 = mask.clone(), mask.clone()
        padded_1[1, 3:] = 0  # the second prompt padded too
        unpadded_0[0] = 1  # the first one not
        return [a, dict(a, encoder_hidden_states_mask=padded_1), dict(a, encoder_hidden_states_mask=unpadded_0),
                dict(a, encoder_hidden_states_mask=padded_1, hidden_states=torch.randn_like(a["hidden_states"]))]

    backend = CapturePassGraphs(strict=True, traced=True)
    runner = _imitated("qwen-image-21", calls, backend)
    assert runner.captures == 1 and runner.replays == 3 and not runner.eager, (runner.captures, runner.eager)
    assert backend.transfers == []
    refs = runner.refs
    assert not torch.equal(refs[0], refs[1]) and not torch.equal(refs[0], refs[2])  # (the masks matter)


def test_qwen21_graphs_key_on_the_image_slot_layout():
    """Two layouts of the same shapes (the condition image's slot at another place in the prompt: only ``img_mask``'s
    values differ) record a graph each, each replayed for its own layout only, equal to unpatched eager. Replayed
    traced (the warm-up's answers baked in, as in a CUDA graph): a key that missed the layout would replay the other
    one's positions here."""
    def calls(model):
        a, b = _qwen21_condition(model, slot=2), _qwen21_condition(model, slot=5)
        return [a, b, dict(a, hidden_states=torch.randn_like(a["hidden_states"])),
                dict(b, timestep=b["timestep"] * 0.5)]

    backend = CapturePassGraphs(strict=True, traced=True)
    runner = _imitated("qwen-image-21", calls, backend)
    assert runner.captures == 2 and runner.replays == 2 and not runner.eager, (runner.captures, runner.eager)
    assert len(set(runner.keys)) == 2 and backend.transfers == []
    assert not torch.equal(runner.refs[0], runner.refs[1])  # (the layouts' outputs differ)


def _fibo2_padded_calls(model):
    a = zoo.inputs("bria-fibo2", model, batch=2, seed=6)
    b = _other_lengths(a, row=1, drop=6)  # gist counts differ: the gist is padded (torch.tensor(gist_counts, ...))
    return [a, b, dict(a, hidden_states=torch.randn_like(a["hidden_states"])), b]


def test_fibo2_padded_gist_records_as_a_capture_does():
    """The GPU test's two sets of text lengths, recorded as a capture records (the key answers ``.tolist()``, the
    gist counts' tensor is filled by `_host_constants`): two graphs, each replayed equal to eager, nothing copied
    from the host or read back."""
    backend = CapturePassGraphs(strict=True)
    runner = _imitated("bria-fibo2", _fibo2_padded_calls, backend)
    assert runner.captures == 2 and runner.replays == 2 and len(runner.kept) == 2 and not runner.eager, runner.eager
    assert backend.transfers == []


def _padded_at(inputs: dict, row: int, start: int) -> dict:
    """The same text lengths, row `row`'s padding moved: its valid tokens start at `start` (left or middle padding)."""
    mask = inputs["encoder_attention_mask"].clone()
    n = int(mask[row].sum())
    mask[row] = False
    mask[row, start:start + n] = True
    return dict(inputs, encoder_attention_mask=mask)


def test_fibo2_graphs_replay_the_same_text_lengths_padded_elsewhere_equal_eager():
    """Bria FIBO 2's key is its text lengths: where the padding sits reaches only its attention masks, on the device.
    So a graph recorded for some lengths replays a mask of the same lengths padded elsewhere (at the start, in the
    middle), equal to unpatched eager with that mask, and other lengths (a padded gist) record their own. Replayed
    traced (no Python: the key's reads and the gist counts baked in, as in a CUDA graph): a key that missed a length
    would replay the other gist here."""
    def calls(model):
        a = zoo.inputs("bria-fibo2", model, batch=2, seed=6)  # lengths 6 and 8
        b = _other_lengths(a, row=1, drop=6)  # lengths 6 and 2: the gist is padded
        return [a, _padded_at(a, row=0, start=2), b, _padded_at(b, row=1, start=3),
                _padded_at(_padded_at(b, row=0, start=1), row=1, start=6)]

    backend = CapturePassGraphs(strict=True, traced=True)
    runner = _imitated("bria-fibo2", calls, backend)
    assert runner.captures == 2 and runner.replays == 3 and not runner.eager, (runner.captures, runner.eager)
    assert len(set(runner.keys)) == 2 and backend.transfers == []
    refs = runner.refs
    assert not any(torch.equal(refs[0], r) for r in refs[1:]) and not torch.equal(refs[2], refs[3])  # (they differ)


def test_fibo2_capture_pass_catches_the_fillers_own_read(monkeypatch):
    """What the H100 refused at 9dcad12 is caught on the CPU: with `_host_constants` reading its host copy by the
    bound ``tolist`` (the twin), the padded signature's capture reads once more than its key holds and runs eager."""
    from diffusers_fastpath import _host_constants

    monkeypatch.setattr(_host_constants, "_host_values", lambda host: host.reshape(-1).tolist())
    runner = _imitated("bria-fibo2", _fibo2_padded_calls, CapturePassGraphs(strict=True))
    assert runner.captures == 2 and len(runner.kept) == 1 and len(runner.eager) == 1, runner.eager
    reason = next(iter(runner.eager))
    assert "(2,) torch.int64 tensor (read 2 of 1 keyed)" in reason, reason


def test_host_transfers_logs_what_a_capture_refuses():
    """Each kind of host copy and device read is logged with its line; what a capture takes is not."""
    x, idx = torch.arange(6.0), torch.tensor([1, 3])  # made outside the pass: "on the device"
    mask = x > 2
    with HostTransfers() as mode:
        torch.ones(3, device=x.device), x[idx], x[1:3], torch.where(mask, x, 0.0), x * torch.tensor(2.0)
        y = x.clone()
        y[idx] = x[idx] * 2
        y[mask] = 0.0  # a single mask and a number: masked_fill_, no nonzero
        y[:2] = 1.0
    assert mode.events == []
    with HostTransfers() as mode:
        torch.tensor([1, 2], device=x.device)
        host = torch.arange(2)
        host.to(x.device)
        x[host]
        x[[0, 1]]
        y[idx] = True
        y[mask] = x[mask]
        torch.where(mask, x, torch.scalar_tensor(0.0))
        x.tolist()
        int(x.sum())
        mask.nonzero()
        torch.repeat_interleave(x, idx.repeat(3))
        x + torch.arange(6.0)
    whats = [w for w, _ in mode.events]
    assert whats == ["torch.tensor of host values to the device", ".to(device) of a host tensor",
                     "__getitem__ with a host index tensor",
                     "__getitem__ with a Python list index (a host index tensor copied over)",
                     "x[indices] = number on a device tensor (a host scalar index_put_ copies over)",
                     "__getitem__ with a boolean device mask (a nonzero: a read)",
                     "__setitem__ with a boolean device mask (a nonzero: a read)",
                     "torch.where with a 0-dim host operand (moved to the device)",
                     "tolist of a device tensor (a read)", "__int__ of a device tensor (a read)",
                     "nonzero of a device tensor (a read)",
                     "repeat_interleave by a device tensor without output_size (a read)",
                     "add mixes host and device tensors"], whats
    assert all(w.startswith("tests/test_capture_host_reads.py:") for _, w in mode.events), mode.events


class _Calls(torch.nn.Module):
    """A module whose forward makes one call (`op`) on its input, then the forward's own arithmetic."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op

    def forward(self, x):
        self.op(x)
        return x * 2


# host-synchronising calls: each needs the values of a device tensor on the host (a Python value, an output size)
_SYNCING = {
    "torch.unique": (lambda x: torch.unique(x), "unique of a device tensor (a read)"),
    "Tensor.unique": (lambda x: x.unique(return_counts=True), "unique of a device tensor (a read)"),
    "torch.unique_consecutive": (lambda x: torch.unique_consecutive(x),
                                 "unique_consecutive of a device tensor (a read)"),
    "torch.where(condition)": (lambda x: torch.where(x > 1),
                               "torch.where(condition) of a device tensor (a nonzero: a read)"),
    "torch.argwhere": (lambda x: torch.argwhere(x), "argwhere of a device tensor (a read)"),
    "Tensor.argwhere": (lambda x: x.argwhere(), "argwhere of a device tensor (a read)"),
    "torch.equal": (lambda x: torch.equal(x, x + 0), "equal of a device tensor (a read)"),
    "Tensor.equal": (lambda x: x.equal(x + 0), "equal of a device tensor (a read)"),
    "torch.allclose": (lambda x: torch.allclose(x.float(), x.float() + 1), "allclose of a device tensor (a read)"),
    "Tensor.allclose": (lambda x: x.float().allclose(x.float()), "allclose of a device tensor (a read)"),
    "torch.bincount": (lambda x: torch.bincount(x), "bincount of a device tensor (a read)"),
    "Tensor.bincount": (lambda x: x.bincount(minlength=8), "bincount of a device tensor (a read)"),
    "f-string": (lambda x: f"lengths {x}", "__format__ of a device tensor (a read)"),
    "f-string of a 0-dim tensor": (lambda x: f"{x.sum():d} tokens", "__format__ of a device tensor (a read)"),
    "str": (lambda x: str(x), "__repr__ of a device tensor (a read)"),
}


@pytest.mark.parametrize("call", list(_SYNCING))
def test_capture_pass_reports_host_synchronising_calls(call):
    """A forward that makes a call which waits for the device (its result needs the values on the host) is reported
    by the imitated capture, at the forward's line, and fails a strict one (as a capture on the GPU refuses it)."""
    op, what = _SYNCING[call]
    module, x = _Calls(op), torch.tensor([1, 2, 2, 3])  # (made outside the capture pass: "on the device")
    backend = CapturePassGraphs()
    _, out = backend.record(backend.new_pool(None), lambda: module(x))
    assert torch.equal(out, x * 2)
    assert [w for w, _ in backend.transfers] == [what], backend.transfers
    assert backend.transfers[0][1].startswith("tests/test_capture_host_reads.py:"), backend.transfers
    with pytest.raises(RuntimeError, match="imitated"):
        CapturePassGraphs(strict=True).record(None, lambda: module(x))


def test_capture_pass_leaves_the_calls_that_do_not_wait_alone():
    """The same kinds of call that read nothing on the host: three-argument ``where``, ``isclose``, a formatted shape,
    and host tensors (the capture pass's own) unique'd, compared and printed."""
    x = torch.tensor([1, 2, 2, 3])

    def forward(x):
        torch.where(x > 1, x, 0), x.where(x > 1, x + 1), torch.isclose(x, x + 1), f"{x.shape} {x.dtype}"
        host = torch.arange(4)
        torch.unique(host), torch.equal(host, host), torch.bincount(host), torch.where(host > 1), f"{host}"
        return x * 2

    backend = CapturePassGraphs(strict=True)
    backend.record(None, lambda: forward(x))
    assert backend.transfers == []


def test_capture_pass_sees_reads_through_the_tolist_twin():
    """While Bria FIBO 2's ``.tolist()`` twin is bound, torch hands its own ``tolist`` call to a function mode as the
    twin: a read that no host key answers (no `HostReads` side) is still logged, at the caller's line; one the key
    answers is not (it reads nothing)."""
    from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel

    x = torch.tensor([[True, False], [True, True]])  # (made outside the pass: "on the device")
    backend = CapturePassGraphs()
    with graphs.capture_twins_bound(BriaFibo2Transformer2DModel):
        assert torch.Tensor.tolist is _host_reads.tolist_twin
        with graphs._side_bound(None):
            assert backend.capture_pass(lambda: x.sum(dim=1).tolist()) == [1, 2]
        assert [w for w, _ in backend.transfers] == ["tolist of a device tensor (a read)"], backend.transfers
        assert backend.transfers[0][1].startswith("tests/test_capture_host_reads.py:"), backend.transfers
        with graphs._side_bound(lambda: _host_reads.HostReads([[7, 7]])):
            assert backend.capture_pass(lambda: x.sum(dim=1).tolist()) == [7, 7]  # (answered: the capture reads none)
    assert len(backend.transfers) == 1


# ----------------------------------------------------------------------------------------------------------- GPU

def _replays_equal_eager(name, calls_of, dtype, full=False, signatures=None):
    model = zoo.build(name, dtype=dtype, device="cuda", seed=5, full=full)
    calls = calls_of(model)
    with torch.no_grad():
        refs = [model(**inputs)[0].clone() for inputs in calls]
    fp.patch(model, cuda_graphs=True)
    try:
        with torch.no_grad():
            outs = [model(**inputs)[0] for inputs in calls]
        stats = fp.report(model).models[0].graphs
    finally:
        fp.unpatch(model)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs)), [torch.equal(o, r) for o, r in zip(outs, refs)]
    n = signatures or 1
    assert stats["status"] == "on" and stats["captured"] == n and stats["replays"] == len(calls) - n, stats
    assert not stats["eager"], stats


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_fibo2_graphs_capture_and_replay_bitwise_per_text_lengths(dtype):
    """Two sets of text lengths (one of them pads the gist: the gist mask, ``torch.tensor(gist_counts)``) record a
    graph each and replay bit-identically to unpatched eager, each for its own lengths."""
    def calls(model):
        a = zoo.inputs("bria-fibo2", model, batch=2, seed=6)
        b = _other_lengths(a, row=1, drop=6)  # lengths 6 and 2: gist counts differ, the gist is padded
        return [a, b, dict(a, hidden_states=torch.randn_like(a["hidden_states"])), b]

    _replays_equal_eager("bria-fibo2", calls, dtype, signatures=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_ideogram4_graphs_capture_and_replay_bitwise(dtype):
    """Ideogram 4's block-diagonal boolean mask goes to torch as the additive mask made on the device: the forward
    captures and every replay is bit-identical to unpatched eager."""
    def calls(model):
        a = zoo.inputs("ideogram4", model, batch=1, seed=6)
        return [a, dict(a, hidden_states=torch.randn_like(a["hidden_states"])), a]

    _replays_equal_eager("ideogram4", calls, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bria-fibo2", "ideogram4", "qwen-image-21"])
def test_full_size_graphs_replay_bitwise(name):
    """The published sizes (the zoo's full inputs): captured, and a replay of new latents equal to eager."""
    if torch.cuda.get_device_properties(0).total_memory < 70 * 2**30:
        pytest.skip("needs an 80 GB card")

    def calls(model):
        a = zoo.inputs(name, model, batch=1, seed=6, full=True)
        return [a, dict(a, hidden_states=torch.randn_like(a["hidden_states"]))]

    _replays_equal_eager(name, calls, torch.bfloat16, full=True)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_qwen21_graphs_capture_and_replay_bitwise(dtype, batch):
    """Qwen-Image 2.1's uncached forward (the pipeline's first step) captures with its data-dependent calls answered
    from the warm-up, and every replay (new latents and timesteps) is bit-identical to unpatched eager."""
    def calls(model):
        a = zoo.inputs("qwen-image-21", model, batch=batch, seed=6)
        return [a, dict(a, hidden_states=torch.randn_like(a["hidden_states"]), timestep=a["timestep"] * 0.5), a]

    _replays_equal_eager("qwen-image-21", calls, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_qwen21_graphs_replay_other_text_masks_per_slot_layout_bitwise(dtype):
    """Two image-slot layouts of the same shapes record a graph each; each replays other text masks (not keyed: read
    on the device) bit-identically to unpatched eager."""
    def calls(model):
        a, b = _qwen21_condition(model, slot=2), _qwen21_condition(model, slot=5)
        other = a["encoder_hidden_states_mask"].clone()
        other[1, 3:] = 0
        return [a, b, dict(a, encoder_hidden_states_mask=other), dict(b, encoder_hidden_states_mask=other),
                dict(a, hidden_states=torch.randn_like(a["hidden_states"]))]

    _replays_equal_eager("qwen-image-21", calls, dtype, signatures=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_fibo2_graphs_replay_the_same_text_lengths_padded_elsewhere_bitwise(dtype):
    """Masks of the recorded text lengths padded elsewhere (at the start, in the middle) replay that graph
    bit-identically to unpatched eager; other lengths (a padded gist) record their own."""
    def calls(model):
        a = zoo.inputs("bria-fibo2", model, batch=2, seed=6)
        b = _other_lengths(a, row=1, drop=6)
        return [a, b, _padded_at(a, row=0, start=2), _padded_at(b, row=1, start=3),
                _padded_at(_padded_at(b, row=0, start=1), row=1, start=6)]

    _replays_equal_eager("bria-fibo2", calls, dtype, signatures=2)
