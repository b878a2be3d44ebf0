"""Which block shape does this platform's eager ``torch.nn.RMSNorm(D)`` reduce a row with, for D > 128?

``torch.nn.RMSNorm`` with a weight of the input's dtype runs ``aten::_fused_rms_norm``, whose CUDA kernel
(``vectorized_layer_norm_kernel<T, float, rms_norm=true>`` in ``aten/src/ATen/native/cuda/layer_norm_kernel.cu``)
reduces each row in one block of (32, W) threads: thread ``t = lane + 32 * warp`` adds the squares of its 4-element
vectors ``t, t + 32 W, ...`` with one FMA each (``sigma2 + x * x``, contracted by nvcc), a shuffle-down tree over
16..1 sums each warp, then shared memory sums the warps (the upper half into the lower, halving), ``/ D``, ``+ eps``,
``rsqrtf``, and ``y = round(w * (rstd * x))``. W is ``num_threads() / 32`` of the aten build; for the per-head QK
norms (D <= 128: warp 0 alone holds data) it does not matter, for the norms across all heads of LTX-Video
(D = 2048) and Wan (D = 5120) it decides every sum. This script emulates each candidate W (every FMA as one fp64
multiply-add rounded to fp32: exact but for a double rounding about once in 2^29 operations) and reports, per W, the
fraction of rows whose ``rstd`` and output match aten bit for bit, for each way of forming the mean square. On the
H200 (torch 2.11.0+cu130, docs/results/gpu_session12_813e546_fbdfd2d.txt) only W = 4 with the IEEE division matches
every row at D = 2048, 3072 and 5120 (bf16 and fp16; the three forms agree at 2048, a power of two): the order
``csrc/rotary.cu``'s row norm reproduces (``ops.qk_norm_rope.ROW_NORM_FINAL = 0``).

    python tools/rms_norm_order_probe.py [--rows 2048] [--dims 2048 3072 5120]
"""

from __future__ import annotations

import argparse
import itertools

import torch

EPS = 1e-6


# How the sum of squares becomes the mean square: ``s / D`` (an IEEE division), ``s * (1 / D)`` (the reciprocal
# rounded first), or that product contracted with ``+ eps`` into one FMA. For D a power of two all three agree.
FINALS = ("div", "mul", "fma")


def emulated_rstd(x: torch.Tensor, warps: int, final: str = "div") -> torch.Tensor:
    """aten's row statistics for a block of (32, `warps`) threads: the fp32 ``rsqrt(sum(x^2) / D + eps)`` per row,
    the division and the ``+ eps`` as `final` says."""
    rows, dim = x.shape
    threads = 32 * warps
    vecs = dim // 4
    xf = x.double()
    acc = torch.zeros(rows, threads, dtype=torch.float64, device=x.device)
    for first in range(0, vecs, threads):  # each thread's vectors in order, each element in order
        n = min(threads, vecs - first)
        chunk = xf[:, 4 * first:4 * (first + n)].reshape(rows, n, 4)
        for j in range(4):
            v = chunk[:, :, j]
            acc[:, :n] = (v * v + acc[:, :n]).float().double()  # fma(v, v, acc) in fp32
    acc = acc.float().reshape(rows, warps, 32)
    for offset in (16, 8, 4, 2, 1):  # shuffle-down tree; lane 0 holds the warp's sum
        shifted = acc.clone()
        shifted[:, :, :32 - offset] = acc[:, :, offset:]
        acc = acc + shifted
    sums = acc[:, :, 0]
    offset = warps // 2
    while offset > 0:  # warps [offset, 2 offset) into [0, offset)
        sums = sums.clone()
        sums[:, :offset] = sums[:, :offset] + sums[:, offset:2 * offset]
        offset //= 2
    total = sums[:, 0]
    if final == "div":  # a tensor divisor: torch turns a division by a Python number into a product with 1 / D
        return torch.rsqrt(total / torch.full_like(total, dim) + EPS)
    inv = torch.tensor(1.0, device=x.device) / dim  # fp32 1 / D, correctly rounded
    if final == "mul":
        return torch.rsqrt(total * inv + EPS)
    return torch.rsqrt((total.double() * inv.double() + EPS).float())  # fma(s, 1 / D, eps): one rounding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--dims", type=int, nargs="+", default=[2048, 3072, 5120])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dim in args.dims:
        for dtype in (torch.bfloat16, torch.float16):
            spread = 0.5 + 4 * torch.rand(args.rows, 1, generator=gen, device="cuda")
            x = (torch.randn(args.rows, dim, generator=gen, device="cuda") * spread).to(dtype)
            w = (1 + 0.1 * torch.randn(dim, generator=gen, device="cuda")).to(dtype)
            out, rstd = torch.ops.aten._fused_rms_norm(x, [dim], w, EPS)
            assert torch.equal(out, torch.nn.functional.rms_norm(x, (dim,), w, EPS))
            line = []
            for warps, final in itertools.product((1, 2, 4, 8, 16), FINALS):
                mine = emulated_rstd(x, warps, final)
                y = (w.float() * (mine[:, None] * x.float())).to(dtype)
                rows_r = (mine == rstd.view(-1)).float().mean().item()
                rows_y = (y == out).all(-1).float().mean().item()
                line.append((rows_r, f"W={warps} {final}: rstd {100 * rows_r:6.2f}% y {100 * rows_y:6.2f}%"))
            line.sort(key=lambda r: -r[0])
            print(f"D={dim} {str(dtype).removeprefix('torch.')}: " + " | ".join(text for _, text in line[:4]))


if __name__ == "__main__":
    main()
