"""The VAEs' transposing copies, tiled against wide: what each moves per second, as a share of a plain copy's.

`csrc/causal_pad.cu` writes a causal convolution's padded input channels-last (Wan's, Qwen-Image's and LTX's decoders)
and `csrc/conv_bias.cu`'s bias_contiguous adds a channels-last convolution output's bias and writes it back
contiguous. Each has two kernels: the tiled one (a 32 x 32 tile of 2-byte moves, `transpose_tile`) that takes any
shape, and the wide one (16-byte vectors both ways, `transpose_tile_wide`) where channels and the vectors' axis are
multiples of 8 and the data 16-byte aligned. This launches both on the same inputs through the NVRTC way (the launch
objects of `diffusers_fastpath.ops.causal_conv_pad` and `diffusers_fastpath.ops.conv_bias`, with each kernel's own
grid), checks that they write the same bytes (their outputs poisoned with NaN first), and times them against
``torch.Tensor.copy_`` of as many bytes (CUDA events, the median of ``--repeats`` calls), at the Wan 2.1, LTX-2 and
FLUX.1 decoders' shapes (or ``--shape B,C,T,H,W``, repeated).

    python tools/transpose_copy_probe.py
    python tools/transpose_copy_probe.py --shape 1,96,4,480,832 --repeats 50

A developer's tool (a CUDA GPU); prints a row per shape and kernel: ms, GB/s (bytes read and written), % of the
copy's GB/s, and whether the wide kernel's output equals the tiled one's; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch
from conv_layout_probe import _time  # this folder's: CUDA events, the median of the repeats

from diffusers_fastpath.ops import _build, _nvrtc

# the op modules (the package binds the ops' names to their functions)
pad = importlib.import_module("diffusers_fastpath.ops.causal_conv_pad")
crms = importlib.import_module("diffusers_fastpath.ops.channel_rmsnorm_silu")
conv_bias = importlib.import_module("diffusers_fastpath.ops.conv_bias")

# (B, C, T, H, W) of the decoders' causal convolutions: Wan 2.1 at 832x480 (one latent frame, two cached, the
# widest stage with four frames), LTX-2 at 768x512x121, FLUX.1's 2-D convolutions at 1024x1024 (T = 1)
SHAPES = [(1, 384, 1, 60, 104), (1, 384, 2, 120, 208), (1, 192, 4, 240, 416), (1, 96, 4, 480, 832),
          (1, 1024, 16, 16, 24), (1, 256, 61, 64, 96), (1, 128, 121, 128, 192), (1, 512, 1, 256, 256),
          (1, 128, 1, 1024, 1024)]


def _both_ways(x: torch.Tensor, cache: torch.Tensor | None, padding: list[int], rsqrt: torch.Tensor | None = None):
    """`causal_conv_pad.launch_fields` for the wide kernel (its output, fields, grid and block) and for the tiled one
    on a buffer of its own (its output, fields and grid: the launcher's where the wide kernel does not fit), for the
    channels-last pad kernels (`rsqrt`: a norm's per-position operands)."""
    out, fields, wide, grid, block = pad.launch_fields(x, cache, padding, True, False, False, rsqrt)
    assert wide, "the wide kernel does not take this shape"
    tiled_out, tiled_fields, _, _, _ = pad.launch_fields(x, cache, padding, True, False, False, rsqrt)
    planes = min(out.shape[0] * out.shape[2] * out.shape[3], pad._MAX_ROW_BLOCKS)
    tiled_grid = ((out.shape[4] + pad._TILE - 1) // pad._TILE,
                  min((x.shape[1] + pad._TILE - 1) // pad._TILE, pad._MAX_ROW_BLOCKS), planes)
    return (out, fields, grid, block), (tiled_out, tiled_fields, tiled_grid)


def _pad_launchers(x: torch.Tensor, cache: torch.Tensor | None, padding: list[int]):
    """The tiled and the wide channels-last pad kernels on x (and the cache), each with its grid, writing into a
    buffer of its own: name -> (run, output)."""
    (out, fields, grid, block), (tiled_out, tiled_fields, tiled_grid) = _both_ways(x, cache, padding)
    dev, dtype = x.device.index, x.dtype
    return {
        "pad tiled": (lambda: pad._NVRTC_CL.launch(dev, dtype, tiled_grid, (pad._TILE, pad._TILE_ROWS, 1),
                                                   *tiled_fields), tiled_out),
        "pad wide": (lambda: pad._NVRTC_WIDE.launch(dev, dtype, grid, block, *fields), out),
    }


def _norm_launchers(x: torch.Tensor, padding: list[int]):
    """The tiled and the wide channel-norm pad kernels (Wan's norm -> SiLU pair written into the convolution's buffer,
    `channel_rmsnorm_silu`'s padded result) on x, no cache: name -> (run, output)."""
    denom = crms.denominator(x).contiguous().view(x.shape[0], -1)
    gamma = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    (out, fields, grid, block), (tiled_out, tiled_fields, tiled_grid) = _both_ways(x, None, padding, denom)
    dev, dtype = x.device.index, x.dtype

    def rest():  # (read at each launch: the launchers' closures keep denom and gamma alive, not only their addresses)
        return denom.data_ptr(), gamma.data_ptr(), 0, float(x.shape[1]) ** 0.5, 0.0

    return {
        "norm tiled": (lambda: crms._NVRTC_PAD.launch(dev, dtype, tiled_grid, (pad._TILE, pad._TILE_ROWS, 1),
                                                      *tiled_fields, *rest()), tiled_out),
        "norm wide": (lambda: crms._NVRTC_PAD_WIDE.launch(dev, dtype, grid, block, *fields, *rest()), out),
    }


def _bias_launchers(raw: torch.Tensor, bias: torch.Tensor):
    """The tiled and the wide bias_contiguous kernels on raw (channels-last) and bias: name -> (run, output)."""
    batch, c = raw.shape[:2]
    spatial = raw.numel() // (batch * c)
    dev, mx = raw.device.index, conv_bias._MAX_ROW_BLOCKS
    outs = {name: torch.empty_like(raw, memory_format=torch.contiguous_format) for name in ("tiled", "wide")}
    assert conv_bias.wide_fits(raw, outs["wide"], None, c, spatial), "the wide kernel does not take this shape"

    def args(out):
        return (out.data_ptr(), raw.data_ptr(), bias.data_ptr(), 0, batch, spatial, c, 0,
                pad._nvrtc.DTYPE_CODE[raw.dtype])

    key = (raw.dtype, False)
    tiled_grid = ((spatial + conv_bias._TILE - 1) // conv_bias._TILE, min((c + conv_bias._TILE - 1) // conv_bias._TILE,
                                                                            mx), min(batch, mx))
    wide_grid = ((spatial + conv_bias._WIDE_POSITIONS - 1) // conv_bias._WIDE_POSITIONS,
                 min((c + conv_bias._WIDE_CHANNELS - 1) // conv_bias._WIDE_CHANNELS, mx), min(batch, mx))
    return {
        "bias tiled": (lambda: conv_bias._NVRTC_CONTIGUOUS.launch(dev, key, tiled_grid,
                                                                  (conv_bias._TILE, conv_bias._TILE_ROWS, 1),
                                                                  *args(outs["tiled"])), outs["tiled"]),
        "bias wide": (lambda: conv_bias._NVRTC_CONTIGUOUS_WIDE.launch(dev, key, wide_grid,
                                                                      (conv_bias._WIDE_THREADS, 1, 1),
                                                                      *args(outs["wide"])), outs["wide"]),
    }


def probe(shape: tuple, dtype: torch.dtype, repeats: int) -> list[dict]:
    """The rows of one shape: the pad kernels (3x3x3 padding, two cached frames where T > 1) and the bias kernels."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    cached = 2 if shape[2] > 1 else 0
    cache = torch.randn(*shape[:2], cached, *shape[3:], generator=gen, device="cuda").to(dtype) if cached else None
    padding = [1, 1, 1, 1, 2 - cached, 0]
    rows = []
    for kind, launchers in (
            ("pad", _pad_launchers(x, cache, padding)),
            ("norm", _norm_launchers(x, [1, 1, 1, 1, 2, 0])),
            ("bias", _bias_launchers(x.contiguous(memory_format=torch.channels_last_3d),
                                     torch.randn(shape[1], generator=gen, device="cuda").to(dtype)))):
        outs = {}
        for name, (run, out) in launchers.items():
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            outs[name] = out.clone()
        (tiled_name, (tiled_run, _)), (wide_name, (wide_run, wide_out)) = launchers.items()
        equal = bool(torch.equal(outs[tiled_name].view(torch.int16), outs[wide_name].view(torch.int16)))
        read = x.numel() * x.element_size() * (1 + 2 / x.shape[1] if kind == "norm" else 1)  # (+ fp32 denom)
        if cache is not None and kind == "pad":
            read += cache.numel() * cache.element_size()
        written = wide_out.numel() * wide_out.element_size()
        if kind == "norm":  # (the first frames inside the border are the convolution's: the kernel leaves them)
            written -= 2 * x.numel() // x.shape[2] * x.element_size()
        src = torch.empty(written, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = _time(lambda: dst.copy_(src), repeats)  # (reads and writes `written` bytes)
        copy_rate = 2 * written / copy_ms / 1e6
        for name, run in ((tiled_name, tiled_run), (wide_name, wide_run)):
            ms = _time(run, repeats)
            rate = (read + written) / ms / 1e6
            rows.append(dict(shape=list(shape), kernel=name, ms=round(ms, 4), gb_s=round(rate, 1),
                             pct_of_copy=round(100 * rate / copy_rate, 1), wide_equals_tiled=equal))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", default=None, help="B,C,T,H,W (repeat for more)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()  # (the NVRTC cubins, whichever way the loader took)
    _nvrtc.build(_build.csrc_dir(), _build.cache_root(), f"{major}{minor}", _build.NVRTC_FLAGS)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else SHAPES
    rows = []
    print(f"{'shape':>26} {'kernel':>11} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'same bytes':>10}")
    for shape in shapes:
        for row in probe(shape, getattr(torch, args.dtype), args.repeats):
            rows.append(row)
            print(f"{str(tuple(row['shape'])):>26} {row['kernel']:>11} {row['ms']:9.4f} {row['gb_s']:8.1f} "
                  f"{row['pct_of_copy']:7.1f} {str(row['wide_equals_tiled']):>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["wide_equals_tiled"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
