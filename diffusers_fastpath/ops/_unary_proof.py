"""Proofs over a whole domain, for the parts of the VAE norm kernels that are a function of one value: the SiLU after
the norm (``csrc/elementwise.cuh``'s ``silu``, aten's ``silu_kernel`` expression with CUDA's ``expf``) and LTX-2's
``round(sqrt(round(m + eps)))`` of each position's mean (`per_channel_rmsnorm`).

A kernel with a probe mode (its function of ``x`` alone, written for every element of a ``[1, 1, n]`` row) is run on
every value of the dtype and compared bit for bit with eager's expression run on the same device: all 65536 bf16 /
fp16 bit patterns in one row, or all 2^32 fp32 bit patterns in chunks of 2^24 (`prove_fp32`: about 200 GB of memory
traffic, a tenth of a second, once per process). Both ways the elementwise kernels run are covered (`mismatches`):
16-byte vectors over a row of a multiple of the vector, one element per thread over that row with one more value.
NaNs with their payloads, infinities and subnormals included. ``channel_rmsnorm_silu`` and ``per_channel_rmsnorm``
prove their kernels' SiLU (and the latter its square root) through these functions, each with its own probe.
`FoldedProof` does it once per device and dtype for a function a kernel folds in place of an eager kernel (the gates'
``tanh`` that ``gated_residual_rows`` and ``gated_layernorm_scale_rows`` take of their rows), with a fallback to that
eager kernel where the proof fails.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch
import torch.nn.functional as F

from .._logging import logger
from ._policy import bits, capturing
from .gelu_cat import every_value

FP32_CHUNK = 1 << 24  # fp32 bit patterns per step of the fp32 proof (64 MiB a tensor)

Probe = Callable[[torch.Tensor], torch.Tensor]  # the kernel's probe mode on a [1, 1, n] row


def mismatches(values: torch.Tensor, probe: Probe, ref: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """How many of `values` (1-D, of one dtype) `probe` gives other bits than eager's `ref`, both ways the kernel runs:
    the values as one row (16-byte vectors, their count a multiple of the vector) and that row with one more value
    (elements: no multiple); a device tensor, not read here."""
    want = bits(ref(values))
    bad = torch.zeros((), dtype=torch.int64, device=values.device)
    for row in (values, torch.cat([values, values[:1]])):  # (the one more value is the first again)
        bad += (bits(probe(row.view(1, 1, -1))).view(-1)[:values.numel()] != want).sum()
    return bad


def prove_fp32(device: torch.device, probe: Probe, ref: Callable[[torch.Tensor], torch.Tensor] = F.silu,
               start: int = -(1 << 31), stop: int = 1 << 31, chunk: int = FP32_CHUNK) -> bool:
    """`probe` equals eager's `ref` on all 2^32 fp32 bit patterns (NaNs with their payloads, infinities, subnormals),
    both ways the kernel runs (`mismatches` on rows of `chunk` values): 256 steps of a few kernels each (64 MiB
    tensors), the mismatches counted on the GPU and read once at the end (one synchronisation). `start`, `stop` (int32
    bit patterns) and `chunk` (a multiple of 4) are the tests' way to run a part of it."""
    bad = torch.zeros((), dtype=torch.int64, device=device)
    for first in range(start, stop, chunk):
        values = torch.arange(first, min(first + chunk, stop), dtype=torch.int32, device=device).view(torch.float32)
        bad += mismatches(values, probe, ref)
    return int(bad) == 0


def prove_every_value(x: torch.Tensor, probe: Probe, ref: Callable[[torch.Tensor], torch.Tensor],
                      fp32_proven: set, fp32_key: Hashable, fp32_proof: Callable[[torch.device], bool]) -> bool:
    """`probe` equals eager's `ref` on every value of x's dtype, on x's device: the 65536 bf16 / fp16 values as one
    row (`mismatches`); for fp32 `fp32_proof(device)` (`prove_fp32`, 2^32 values), run once per `fp32_key` (the device,
    and whatever else the function depends on) and remembered in `fp32_proven` when it passed (each fp32 signature of
    an op would otherwise run it again); a failure is not remembered."""
    if x.dtype == torch.float32:
        if fp32_key not in fp32_proven:
            if not fp32_proof(x.device):
                return False
            fp32_proven.add(fp32_key)
        return True
    return int(mismatches(every_value(x.dtype, x.device).flatten(), probe, ref)) == 0


def tanh_chain_ref(values: torch.Tensor) -> torch.Tensor:
    """Eager's gated residual ``residual + gate.tanh() * update`` with a residual of -0 and an update of 1, by aten on
    `values`' device: for every value whose tanh is not a NaN, the tanh rounded to the dtype itself (``-0 + t * 1`` is
    exactly ``t``, the signs of zeros included); a NaN through aten's arithmetic, as the kernels' next operations make
    of one (the product and the sum that read the gate)."""
    return values.new_full(values.shape, -0.0) + values.tanh() * values.new_ones(values.shape)


class FoldedProof:
    """Whether a kernel's function of one value that stands for an eager kernel it folds (the gates' ``tanh`` read by
    Qwen-Image 2.1's gated residual kernels) gives eager's bits on every value of a dtype on a device: `mismatches` of
    `probe` against `ref` over the 65536 bf16 / fp16 values, run once per (device, dtype) on the first call that asks
    and remembered either way. A proof that fails, or cannot run (a kernel that fails to build or launch, or a CUDA
    graph being captured, where it would synchronise: then not remembered), answers False: the op then reads eager's
    own kernel's result instead (the folded function unused), after one warning for a failure.

    Args:
        name: what is proven, for the warning.
        probe: the kernel's probe on a ``[1, 1, n]`` row (`Probe`).
        ref: eager's expression of the same (`tanh_chain_ref`).
    """

    def __init__(self, name: str, probe: Probe, ref: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.name, self.probe, self.ref = name, probe, ref
        self.results: dict[tuple, bool] = {}  # (device, dtype) -> proven

    def known(self, device: torch.device, dtype: torch.dtype) -> bool:
        """What `holds` answered for (device, dtype), without running the proof: False where it has not run (an op's
        verification key reads it after its kernel ran, to say which form that was)."""
        return self.results.get((device, dtype), False)

    def holds(self, device: torch.device, dtype: torch.dtype) -> bool:
        key = (device, dtype)
        proven = self.results.get(key)
        if proven is not None:
            return proven
        if capturing():
            return False
        try:
            proven = int(mismatches(every_value(dtype, device).flatten(), self.probe, self.ref)) == 0
            cause = "differs from eager's on some values"
        except Exception as exc:  # noqa: BLE001 - the folded form is not used; the op runs as before
            proven, cause = False, f"could not run ({type(exc).__name__}: {exc})"
        self.results[key] = proven
        if not proven:
            logger.warning(f"diffusers_fastpath: {self.name} on {device} for {str(dtype).removeprefix('torch.')} "
                           f"{cause}; eager's own kernel computes it instead (same numbers, one launch more)")
        return proven
