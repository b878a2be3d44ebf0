"""Which order does this build's eager ``x.float().pow(2).mean(-1)`` take over rows wider than 8160, and does the
`rmsnorm` kernel (``csrc/rmsnorm_scale_shift.cu``'s ``rmsnorm_wide_kernel``) equal diffusers' RMSNorm there?

Past 8160 aten's setReduceConfig splits a row across the 16 warps of its (32, 16) block
(`diffusers_fastpath.ops._aten_reduce.set_reduce_config`, printed per width): thread (lane, y) sums its quads
``lane + 32 y + 512 k`` in four accumulators, then the block combines the 512 thread sums. How it combines them is
the build's: torch 2.13's Reduce.cuh shuffles each warp (16..1) and then sums the warps through shared memory
(``xy``, what the kernel does); older builds summed the warps lane by lane first (``yx``), some with the ascending
shuffle (1..16); a build taking vt0 8 for fp32 reductions over a multiple of 1024 reads vectors of 8 (``vec8``).
Each candidate is emulated exactly (every fp32 addition a separate, correctly rounded torch op) and compared with
aten's mean row by row; ``kernel`` compares the op's kernel (bf16 / fp16 x; its guard admits at least 16 rows) with
diffusers' forward over all elements (torch.equal). fp32 x has no kernel (the guard takes bf16 / fp16): its rows test
the order alone (the mean reads the same fp32 squares).

    python tools/wide_rmsnorm_probe.py [--dims 8164 8192 ... ] [--rows 1 16 2048] [--dtypes bf16 fp16 fp32]
"""

from __future__ import annotations

import argparse
import itertools
import sys

DIMS = (4096, 8160, 8164, 8188, 8192, 9996, 12288, 16384, 32768, 33332, 53248, 53252, 65536, 130560, 130564)
ROWS = (1, 7, 16, 300, 2048)
DTYPES = ("bf16", "fp16", "fp32")
# (vector width, block combine, shuffle order): "xy" block_x_reduce then block_y_reduce (torch 2.13), "yx" the reverse
CANDIDATES = tuple(itertools.product((4, 8), ("xy", "yx"), ("down", "up")))


def _shuffle(v, down: bool):
    """``v += shfl_down(v, offset)`` over the last dim (a warp's lanes) for offset 16..1 (`down`) or 1..16; lane 0's
    value (a lane whose source is past the warp adds its own value, as the hardware returns it)."""
    lanes = v.shape[-1]
    offsets = [1 << i for i in range(lanes.bit_length() - 1)]
    for off in reversed(offsets) if down else offsets:
        shifted = v.clone()
        shifted[..., : lanes - off] = v[..., off:]
        v = v + shifted
    return v[..., 0]


def _tree(v):
    """block_y_reduce over the last dim: v[y] += v[y + off] for off = n / 2 .. 1; v[0]."""
    off = v.shape[-1] // 2
    while off:
        v = v.clone()
        v[..., :off] = v[..., :off] + v[..., off:2 * off]
        off //= 2
    return v[..., 0]


def emulated_sum(sq, width: int, warps: int, vec: int, combine: str, shuffle: str):
    """aten's vectorised row sum of fp32 `sq` ``[R, D]`` (D % vec == 0) by a block of (`width`, `warps`) threads on one
    row: thread t = lane + width y adds vectors t, t + width warps, ... into `vec` accumulators, combines them in order,
    then the block combines the threads as `combine` and `shuffle` say."""
    import torch

    rows, dim = sq.shape
    threads = width * warps
    steps = -(-(dim // vec) // threads)
    padded = torch.zeros(rows, steps * threads * vec, dtype=torch.float32, device=sq.device)
    padded[:, :dim] = sq  # (adding 0 to a sum of squares changes nothing)
    chunks = padded.view(rows, steps, threads, vec)
    acc = torch.zeros(rows, threads, vec, dtype=torch.float32, device=sq.device)
    for k in range(steps):
        acc = acc + chunks[:, k]
    total = acc[..., 0]
    for j in range(1, vec):
        total = total + acc[..., j]
    total = total.view(rows, warps, width)
    down = shuffle == "down"
    if combine == "xy":
        return _tree(_shuffle(total, down))
    return _shuffle(_tree(total.transpose(1, 2)), down)


def probe(dim: int, rows: int, dtype_name: str, gen) -> str:
    import torch

    from diffusers_fastpath.ops._aten_reduce import set_reduce_config
    from diffusers_fastpath.ops.rmsnorm_scale_shift import _f32, _rms_norm

    rmsnorm_mod = sys.modules["diffusers_fastpath.ops.rmsnorm"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    props = torch.cuda.get_device_properties(0)
    spread = 1.0 if dtype == torch.float16 else 3.0
    x = (torch.randn(rows, dim, generator=gen, device="cuda") * spread).to(dtype)
    sq = x.float().pow(2)
    aten = sq.mean(-1)
    factor = torch.tensor(_f32(_f32(rows) / _f32(rows * dim)), dtype=torch.float32, device="cuda")
    cfg = set_reduce_config(rows, dim, True, props.multi_processor_count, props.max_threads_per_multi_processor)
    warps = cfg.block_height if cfg.split_across_warps else 1
    shape = f"block ({cfg.block_width}, {cfg.block_height}), {'split' if cfg.split_across_warps else 'a row per warp'}"
    if cfg.ctas_per_output > 1:
        matches = f"not emulated: {cfg.ctas_per_output} blocks per row (global_reduce)"
    elif cfg.block_width != 32 or cfg.input_vec_size == 1:
        matches = "not emulated: a block wider than a warp or an unvectorised row"
    else:
        found = []
        for vec, combine, shuffle in CANDIDATES:
            if dim % vec:
                continue
            mean = emulated_sum(sq, cfg.block_width, warps, vec, combine, shuffle) * factor
            share = (mean == aten).float().mean().item()
            if share == 1.0 or vec == 4:
                found.append(f"vec{vec}-{combine}-{shuffle} {100 * share:.1f}%")
        matches = ", ".join(found)
    kernel = "-"
    if dtype != torch.float32:
        weight = (1 + 0.3 * torch.randn(dim, generator=gen, device="cuda")).to(dtype)
        ref = _rms_norm(x, weight, 1e-6)
        got = rmsnorm_mod._launch(x.view(rows, 1, dim), weight, 1e-6).view(rows, dim)
        kernel = "equal" if torch.equal(got, ref) else f"DIFFERS ({(got != ref).any(-1).sum().item()} rows)"
        if rows < 16 or dim > rmsnorm_mod._WIDEST:
            kernel += " (guard refuses)"
    return f"| {dim} | {dtype_name} | {rows} | {shape} | {matches} | {kernel} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=list(DIMS), help="row widths (multiples of 4)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from diffusers_fastpath.ops._build import load_extension

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kernels {load_extension()}")
    print("| D | x | rows | aten's block | emulated orders: rows equal to aten's mean | kernel vs diffusers |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    with torch.no_grad():
        for dim, dtype, rows in itertools.product(args.dims, args.dtypes, args.rows):
            if dim % 4:
                raise SystemExit(f"--dims: {dim} is no multiple of 4 (the kernel reads quads)")
            print(probe(dim, rows, dtype, gen), flush=True)


if __name__ == "__main__":
    main()
