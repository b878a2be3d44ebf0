"""Which summation order does this platform's eager ``x.float().pow(2).mean(-1)`` use?

A fused RMSNorm is bit-identical to eager only if it adds the squares in the order of the aten reduce kernel that
``mean`` dispatches to, which depends on the torch build. This script emulates candidate orders exactly (every
fp32 addition is a separate, correctly rounded torch op) and reports, for each, the fraction of rows whose mean
matches aten bit for bit. On an H200 with torch 2.11 only "lanes=32 vec=4 tree=16..1" matched all rows; that is
the order ``csrc/rmsnorm_scale_shift.cu`` implements. Short rows (``--dim 128``: the per-head QK norms of Qwen-Image,
Z-Image, Lumina2) may take aten's unvectorised path, whose lanes hold strided elements ("strided" below).

    python tools/reduction_order_probe.py [--rows 4216] [--dim 4096]
"""

from __future__ import annotations

import argparse

import torch


def lane_sums(sq: torch.Tensor, lanes: int, vec: int) -> torch.Tensor:
    """Lane l keeps `vec` accumulators; accumulator j adds sq[vec * (l + lanes * k) + j] for k = 0, 1, ...; the
    accumulators are then combined in order: ((a_0 + a_1) + a_2) + ..."""
    rows, dim = sq.shape
    s = sq.reshape(rows, dim // (vec * lanes), lanes, vec)
    acc = torch.zeros(rows, lanes, vec, device=sq.device)
    for k in range(s.shape[1]):
        acc = acc + s[:, k]
    total = acc[:, :, 0]
    for j in range(1, vec):
        total = total + acc[:, :, j]
    return total


def strided_lane_sums(sq: torch.Tensor, lanes: int, vt: int) -> torch.Tensor:
    """aten's unvectorised thread reduce: lane l keeps `vt` accumulators; accumulator i adds sq[l + lanes * (i + vt * k)]
    for k = 0, 1, ...; then ((a_0 + a_1) + a_2) + ..."""
    rows, dim = sq.shape
    s = sq.reshape(rows, dim // (vt * lanes), vt, lanes)
    acc = torch.zeros(rows, vt, lanes, device=sq.device)
    for k in range(s.shape[1]):
        acc = acc + s[:, k]
    total = acc[:, 0]
    for i in range(1, vt):
        total = total + acc[:, i]
    return total


def shuffle_tree(v: torch.Tensor, offsets) -> torch.Tensor:
    """``value += shfl_down(value, offset)`` for each offset, read at lane 0."""
    for off in offsets:
        shifted = v.clone()
        shifted[:, : v.shape[1] - off] = v[:, off:]
        v = v + shifted
    return v[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4216)
    parser.add_argument("--dim", type=int, default=4096)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(args.rows, args.dim, device=device) * 3).to(torch.bfloat16)
    aten = x.float().pow(2).mean(-1)
    sq = x.float().pow(2)
    factor = torch.tensor(float(args.rows) / float(args.rows * args.dim), dtype=torch.float32, device=device)
    for lanes, vec, layout in [(l, v, k) for l in (16, 32, 64) for v in (2, 4, 8) for k in ("vec", "strided")]:
        if args.dim % (lanes * vec):
            continue
        sums = (lane_sums if layout == "vec" else strided_lane_sums)(sq, lanes, vec)
        for name, offsets in (("1..", [2**i for i in range(lanes.bit_length() - 1)]),
                              ("..1", [2**i for i in reversed(range(lanes.bit_length() - 1))])):
            mean = shuffle_tree(sums, offsets) * factor
            match = (mean == aten).float().mean().item()
            print(f"{layout:7s} lanes={lanes:<3d} vec={vec} tree={offsets[0]}..{offsets[-1]}: {100 * match:6.2f}% of rows match")


if __name__ == "__main__":
    main()
