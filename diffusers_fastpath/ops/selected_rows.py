"""Modulation rows a model picks per token from a few rows, kept as those rows and an index instead of written out.

Qwen-Image 2.1's blocks choose each token's scale and gate with ``_select_modulation_rows(params, mask)``::

    torch.where(mask.view(1, -1, 1), params[:-1].unsqueeze(1), params[-1:].unsqueeze(0))   # [B, S, D]

(``params`` the ``[B + 1, D]`` chunk of the shared modulation: sample b's row for target-image tokens, the ``t = 0``
row for text and condition tokens), and then use the ``[B, S, D]`` result once: in ``norm(x) * (1 + scale)`` and in
``x + gate.tanh() * y``. Eager writes each such tensor (four per block) and reads it back; `SelectedRows` keeps
``params``, the mask and the function, and gives the fused kernels a table and an int32 ``[B, S]`` index instead:
row ``(b, s)`` is ``table[index[b, s]]`` with ``index[b, s] = b if mask[s] else B``, the row the ``where`` picks.

Why it is exact: the ``where`` moves values and computes nothing, so the kernels read the very values eager would
have written. The gate's ``tanh`` is applied to the ``[B + 1, D]`` table instead of the ``[B, S, D]`` rows: the same
aten kernel on the same values, elementwise, so each picked row holds the same bits (and the fused op that reads it
checks its first call against eager per signature besides). Anything the fast form does not take falls back to
`materialize`, which is the model's own expression, called as the model calls it.

The same for two other forms: MiniMax-H3's ``table.index_select(0, index)`` rows (`IndexedRows`), and Bria FIBO 2's
and Z-Image's ``select_per_token(noisy, clean, mask, S)``, a ``where`` between two ``[B, D]`` row sets per token
(`TokenRows`: the table the two sets, ``[2B, D]``).
"""

from __future__ import annotations

import torch


class SelectedRows:
    """``select(params, mask)`` (then ``.tanh()`` where `tanh`), not yet computed.

    Args:
        select: the model's row-selection function (the one the patched method checked by digest).
        params: its ``[B + 1, D]`` rows.
        mask: ``[S]`` bool, ``True`` where a token takes its own sample's row.
        tanh: whether the rows are used through ``.tanh()`` (the gates).
        index: the index `index` makes, where the caller has it already (rows of the same mask).
    """

    __slots__ = ("select", "params", "mask", "tanh", "_table", "_index", "_taken", "_later")

    def __init__(self, select, params: torch.Tensor, mask: torch.Tensor, tanh: bool = False,
                 index: torch.Tensor | None = None) -> None:
        self.select, self.params, self.mask, self.tanh = select, params, mask, tanh
        self._table, self._index, self._taken, self._later = None, index, False, False

    @classmethod
    def tanh_taken(cls, select, params: torch.Tensor, mask: torch.Tensor,
                   index: torch.Tensor | None) -> SelectedRows:
        """A lazy gate's rows (`_norm_methods.lazy_gates`: the rewriter proved they are read once, as
        ``tanh_rows(G)``), kept as eager's ``where`` would read them now, in as few kernels as that takes: the table
        is ``params.tanh()`` computed now (one kernel reading the rows' view and writing a new tensor: the rows' values
        now, through the tanh that eager computes later on the very values its ``where`` copies now; tanh is
        elementwise, so the picked rows of the table's tanh are the tanh of the picked rows), and the mask's values now
        are `index`'s (made from the mask as it is now: row 0 of it is 0 exactly where the mask holds, the table's
        other rows being B >= 1), read back only by `materialize`; without an index, a copy of the mask. The result
        is already the gate's ``.tanh()``: `tanh_rows` returns it as it is.

        Where autograd records (the rows require grad; the kernels refuse, the fallback runs), the gradient of the
        rows must be eager's (the tanh's backward on each picked row, then the ``where``'s sum over the tokens, not
        the other way round): there the rows and the mask are copied as they are and the tanh waits for `tanh_rows`,
        the model's own order."""
        if torch.is_grad_enabled() and params.requires_grad:
            return cls(select, params.clone(), mask.clone(), index=index)
        rows = cls(select, params.tanh(), mask if index is not None else mask.clone(), tanh=True, index=index)
        rows._table, rows._taken = rows.params, True
        return rows

    @classmethod
    def read_later(cls, select, params: torch.Tensor, mask: torch.Tensor, index: torch.Tensor | None) -> SelectedRows:
        """A lazy gate's rows where the rewriter also proved that nothing writes what `params` holds between the
        method's call and the one gated residual that reads them (`_norm_methods.lazy_gates`: ``LATER``): the rows
        are ``params`` as they are (a view: no kernel), read by that residual's kernel, which takes their ``.tanh()``
        itself where it proved its tanh is aten's on every value of the dtype (`folds_tanh`), else reads `table`, aten's
        tanh of them (one kernel then, as `tanh_taken`). The mask's values are `index`'s, as `tanh_taken`'s (without
        an index, a copy of the mask). The result is already the gate's ``.tanh()``: `tanh_rows` returns it as it is;
        `materialize` is the model's ``select(params, mask).tanh()`` (where autograd records too: the model's order)."""
        rows = cls(select, params, mask if index is not None else mask.clone(), tanh=True, index=index)
        rows._later = True
        return rows

    @property
    def folds_tanh(self) -> bool:
        """Whether a kernel may take these rows' ``.tanh()`` of `params` itself (`read_later`'s, the table not yet
        computed by aten)."""
        return self._later and self._table is None

    def _mask_values(self) -> torch.Tensor:
        """The mask's values the rows were picked with (`tanh_taken`, `read_later`: those held by the index's row 0)."""
        if (self._taken or self._later) and self._index is not None:
            return self._index[0] == 0
        return self.mask

    def materialize(self) -> torch.Tensor:
        """The model's expression: ``select(params, mask)``, then ``.tanh()`` for a gate (`tanh_taken`: the tanh taken
        on the table, the mask read back from the index)."""
        rows = self.select(self.params, self._mask_values())
        return rows.tanh() if self.tanh and not self._taken else rows

    def tanh_rows(self) -> SelectedRows:
        """These rows through ``.tanh()`` (what the gate's ``g.tanh()`` is): the tanh of the table computed now,
        where eager computes its own, the rows still not written out (`tanh_taken`'s and `read_later`'s rows:
        themselves)."""
        if self._taken or self._later:
            return self
        rows = SelectedRows(self.select, self.params, self.mask, tanh=True, index=self._index)
        rows.table()
        return rows

    def table(self) -> torch.Tensor:
        """The ``[B + 1, D]`` rows the index picks from: ``params`` (a view), or ``params.tanh()`` (computed once)."""
        if not self.tanh:
            return self.params
        if self._table is None:
            self._table = self.params.tanh()
        return self._table

    def index(self) -> torch.Tensor:
        """int32 ``[B, S]``: ``b`` where ``mask`` holds, ``B`` (the last row) elsewhere (`where_index`)."""
        if self._index is None:
            self._index = where_index(self.mask, self.params.shape[0] - 1, self.params.device)
        return self._index

    @property
    def cached_index(self) -> torch.Tensor | None:
        """The index if `index` made it already, else ``None``."""
        return self._index

    def reason(self, x: torch.Tensor) -> str | None:
        """Why these rows cannot be read through an index for a ``[B, S, D]`` operand `x` (where the ``where``'s
        broadcast would give another shape than ``x``'s, or the operands are not what its form says), or ``None``."""
        params, mask = self.params, self.mask
        if not (isinstance(params, torch.Tensor) and isinstance(mask, torch.Tensor) and isinstance(x, torch.Tensor)):
            return "rows operand not a tensor"
        if params.dim() != 2 or x.dim() != 3 or params.shape[0] < 2 or mask.dim() != 1:
            return "rows shape"
        if mask.dtype is not torch.bool or x.shape != (params.shape[0] - 1, mask.shape[0], params.shape[1]):
            return "rows shape"
        if params.dtype is not x.dtype:
            return "mixed dtypes"
        if mask.device != params.device:
            return "devices differ"
        if (self._taken or self._later) and self._index is not None and self._index.shape != x.shape[:2]:
            return "rows shape"  # (the mask resized in place since: its values are the index's)
        return None


class IndexedRows:
    """``table.index_select(0, index)``, not yet computed: MiniMax-H3's per-token modulation rows.

    MiniMax-H3's blocks pick each token's shift, scale and gate from ``[T * 3, D]`` tables (one row per timestep and
    modality) with ``table.index_select(0, adaln_indices)`` (``[N]`` int64, the caller's) and use each ``[N, D]``
    result once: in ``norm(x) * (1.0 + scale) + shift`` and in ``residual + gate * y``. The rewritten forward hands
    the fused ops this object instead (`_chain_calls`), which they read through the index (`table`, `index`); every
    fallback writes the rows out with the model's own call (`materialize`). Exact for the same reason as
    `SelectedRows`: ``index_select`` moves values and computes nothing.

    An index outside the table makes eager's ``index_select`` fail (an ``IndexError`` on a CPU, a device assert on a
    GPU); `index` keeps such values outside ``[0, rows)`` when it narrows them to int32 (clamped to -1 or ``rows``,
    no host sync), and the kernels trap on them: nothing is read out of bounds, and the run fails as eager's does.

    Args:
        params: the table (its ``index_select`` is called as the model calls it: any object, for the fallback).
        indices: the caller's ``[N]`` indices.
    """

    __slots__ = ("params", "indices", "_index")
    tanh = False  # (what `SelectedRows`' readers ask: these rows are used as they are)

    def __init__(self, params, indices) -> None:
        self.params, self.indices, self._index = params, indices, None

    def materialize(self) -> torch.Tensor:
        """The model's expression: ``params.index_select(0, indices)``."""
        return self.params.index_select(0, self.indices)

    def table(self) -> torch.Tensor:
        """The ``[rows, D]`` table the index picks from."""
        return self.params

    def index(self) -> torch.Tensor:
        """int32 ``[N]``: the indices where they are in ``[0, rows)``, -1 or ``rows`` (which the kernels trap on) where
        they are not; made on the device, no sync (int32 indices as they are: the kernels check them)."""
        if self._index is None:
            indices = self.indices
            if indices.dtype is not torch.int32:
                indices = indices.clamp(-1, self.params.shape[0]).to(torch.int32)
            self._index = indices.contiguous()
        return self._index

    @property
    def cached_index(self) -> torch.Tensor | None:
        return self._index

    def reason(self, x: torch.Tensor) -> str | None:
        """Why these rows cannot be read through the index for an operand `x` of ``[..., N, D]`` with every leading
        dimension 1 (where ``index_select``'s ``[N, D]`` broadcast against it gives x's shape), or ``None``."""
        params, indices = self.params, self.indices
        if not (isinstance(params, torch.Tensor) and isinstance(indices, torch.Tensor) and isinstance(x, torch.Tensor)):
            return "rows operand not a tensor"
        if params.dim() != 2 or indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32) or x.dim() < 2:
            return "rows shape"
        if x.shape[-2:] != (indices.shape[0], params.shape[1]) or x.numel() != indices.shape[0] * params.shape[1]:
            return "rows shape"
        if params.shape[0] == 0 or params.shape[0] >= 2 ** 31 - 1:
            return "rows shape"
        if params.dtype is not x.dtype:
            return "mixed dtypes"
        if indices.device != params.device:
            return "devices differ"
        return None


class TokenRows:
    """``select(noisy, clean, mask, seq_len)``, not yet written out: Bria FIBO 2's and Z-Image's per-token rows.

    Their blocks pick each token's scales and gates with the module function ``select_per_token``::

        torch.where(mask.unsqueeze(-1) == 1, noisy.unsqueeze(1).expand(-1, S, -1), clean.unsqueeze(1).expand(-1, S, -1))

    (``noisy`` and ``clean`` the ``[B, D]`` rows of the sample's timestep and of ``t = 0``, already through their
    ``1.0 +`` or ``.tanh()``; ``mask`` ``[B, S]``), and use each ``[B, S, D]`` result once, in ``norm(x) * scale``
    or ``x + gate * norm(y)``. The rewritten forward makes this object at that call instead (`models.
    _chain_token_rows`), from what the ``where`` reads there: a ``[2B, D]`` table (``noisy``'s rows, then
    ``clean``'s: a copy), the int32 ``[B, S]`` index of the row each token takes (``b`` where ``mask[b, s] == 1``,
    else ``B + b``: `token_index`, the model's own function applied to row numbers) and a copy of the mask. The fused
    kernels read the table through the index; every fallback writes the rows out with the model's function, called
    on those copies as the model calls it on the originals (`materialize`). Exact: the ``where`` moves values and
    computes nothing, and what it would read is what was copied at its call.

    Args:
        select: the model's function (the one the rewriter checked by digest).
        table: ``torch.cat([noisy, clean])``.
        mask: the mask (a copy).
        seq_len: ``S``.
        index: `token_index` of that mask.
    """

    __slots__ = ("select", "_table", "mask", "seq_len", "_index")
    tanh = False  # (what `SelectedRows`' readers ask: these rows are used as they are)

    def __init__(self, select, table: torch.Tensor, mask: torch.Tensor, seq_len: int, index: torch.Tensor) -> None:
        self.select, self._table, self.mask, self.seq_len, self._index = select, table, mask, seq_len, index

    def materialize(self) -> torch.Tensor:
        """The model's expression: ``select(noisy, clean, mask, seq_len)`` (of the copies)."""
        half = self._table.shape[0] // 2
        return self.select(self._table[:half], self._table[half:], self.mask, self.seq_len)

    def table(self) -> torch.Tensor:
        """The ``[2B, D]`` rows the index picks from."""
        return self._table

    def index(self) -> torch.Tensor:
        """int32 ``[B, S]``, contiguous: the table row of each token."""
        return self._index

    @property
    def cached_index(self) -> torch.Tensor:
        return self._index

    def reason(self, x: torch.Tensor) -> str | None:
        """Why these rows cannot be read through the index for a ``[B, S, D]`` operand `x` (another shape than the
        ``where``'s, another dtype or device), or ``None``."""
        table, index = self._table, self._index
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape != (*index.shape, table.shape[1]):
            return "rows shape"
        if table.dtype is not x.dtype:
            return "mixed dtypes"
        if table.device != x.device:
            return "devices differ"
        return None


def where_index(mask: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """int32 ``[batch, S]``: the row of `SelectedRows`' ``[batch + 1, D]`` table the ``torch.where`` puts at each of
    the ``S`` tokens of the ``[S]`` bool `mask`: ``b`` where it holds, ``batch`` elsewhere. Made on `device`, no sync."""
    samples = torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)
    return torch.where(mask.view(1, -1), samples, batch)


def token_index(select, mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """int32 ``[B, S]``: the row of a ``[2B, D]`` table (`TokenRows`) that ``select(noisy, clean, mask, seq_len)``
    puts at each token, computed by `select` itself on row numbers (``[B, 1]`` of ``b`` for ``noisy``, of ``B + b``
    for ``clean``): ``b`` where ``mask[b, s] == 1``, else ``B + b``. Made on the mask's device, no sync."""
    batch = mask.shape[0]
    rows = torch.arange(batch, dtype=torch.int32, device=mask.device).unsqueeze(1)
    return select(rows, rows + batch, mask, seq_len).reshape(batch, seq_len).contiguous()


def index_rows(params, indices):
    """``params.index_select(0, indices)`` for the rewritten forwards (a fused op's operand only): `IndexedRows`."""
    return IndexedRows(params, indices)


def materialized(rows):
    """The tensor `rows` stands for (`SelectedRows`, `IndexedRows`, `TokenRows`: written out as the model writes them), else
    `rows` as it is."""
    return rows.materialize() if type(rows) in (SelectedRows, IndexedRows, TokenRows) else rows


def indexed_pair_reason(scale: IndexedRows, shift: IndexedRows, x: torch.Tensor) -> str | None:
    """Why a modulate's `scale` and `shift` `IndexedRows` cannot be read through their index for an operand `x`
    (`IndexedRows.reason` of each), not being of one index object over tables of one shape, or their tables' rows not
    whole 16-byte vectors apart (`table_rows_aligned`); or ``None``."""
    reason = scale.reason(x) or shift.reason(x)
    if reason is not None:
        return reason
    if scale.indices is not shift.indices or scale.params.shape != shift.params.shape:
        return "rows of other indices"
    if not (table_rows_aligned(scale.params) and table_rows_aligned(shift.params)):
        return "scale/shift strided"
    return None


def table_rows_aligned(table: torch.Tensor) -> bool:
    """Whether the kernels can read each row of a ``[rows, D]`` table as 16-byte vectors where its first row can be:
    unit innermost stride, and a row stride of whole 16-byte vectors (any stride where the table has one row). The
    first row's own alignment and width are the fused op's guard's to check."""
    return table.stride(1) == 1 and (table.shape[0] == 1 or table.stride(0) % (16 // table.element_size()) == 0)


def tanh_rows(gate):
    """``gate.tanh()`` for the rewritten forwards' lazy gates: `SelectedRows` stay rows (`SelectedRows.tanh_rows`),
    anything else is the expression as written."""
    return gate.tanh_rows() if type(gate) is SelectedRows else gate.tanh()
