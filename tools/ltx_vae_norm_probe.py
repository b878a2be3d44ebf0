"""LTX-Video's VAE norm -> SiLU -> causal convolution input from x in one kernel (ops/ltx_vae_rmsnorm_conv.py's fused
kernel: per_channel_rmsnorm_pad.cu's pad kernel with kLtx), shape by shape on this GPU.

For each norm shape of LTX-Video's decode at 768x512x121 and each dtype: the order `mean_order` derives here (rows x
ctas partial sums, or why aten's mean is kept), the kernel's mean (probe mode 3) against eager's
``x.movedim(1, -1).to(float32).pow(2).mean(-1)`` bit for bit, its padded buffer against the path before's (the
squares kernel, aten's mean and rsqrt, causal_pad.cu's ltx_rmsnorm_pad_cl_kernel) bit for bit, and the median time
of that path before and of the fused kernel, with the fused kernel's GB/s over x read twice and the buffer written
once.

    python tools/ltx_vae_norm_probe.py [--dtypes bf16,fp16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import importlib

import torch

from diffusers_fastpath.ops._policy import tensors_equal
from measure_stores import _time  # (tools/: median ms of CUDA-event timed calls)

chain = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm_conv")
ltx_norm = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm")

SHAPES = {  # [B, C, T, H, W] -> the decode's chains at that shape (decoder_layers_per_block (4, 3, 3, 3, 4): the mid
    # block's 4 resnets and the first up block's 3 at 512 x 16 frames; then 3 resnets after each upsampling, the up
    # blocks' conv_in resnets changing the channels before it (norm1 at the old width, norm2 at the new), norm_out)
    "512 x 16": ((1, 512, 16, 16, 24), 14), "512 x 31": ((1, 512, 31, 32, 48), 7),
    "256 x 31": ((1, 256, 31, 32, 48), 1), "256 x 61": ((1, 256, 61, 64, 96), 7),
    "128 x 61": ((1, 128, 61, 64, 96), 1), "128 x 121": ((1, 128, 121, 128, 192), 9),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-8
PADDING = [0, 0, 0, 0, 1, 1]  # the decoder's non-causal convolutions: the first and the last frame once each


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, {props.max_threads_per_multi_processor} threads each; "
          f"torch {torch.__version__}")
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        saved = 0.0
        for name, (shape, calls) in SHAPES.items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
            b, c = shape[:2]
            x3, dims = x.reshape(b, c, -1), list(shape[2:])
            order = chain.mean_order(x)

            def before():
                r = ltx_norm.reciprocal(x.movedim(1, -1), EPS, ltx_norm._square).contiguous()
                return chain._launch(x, r.view(b, -1), PADDING, False)

            line = f"{dname} {name:10s} {str(shape):24s}"
            t_before = _time(before, args.repeats) * 1e3
            if type(order) is not chain._pcr.MeanOrder:
                print(f"{line} aten's mean ({order}); before {t_before:8.1f} us")
                continue

            def fused(probe=0):
                return chain._launch_fused(x3, EPS, probe == 0, order.rows, order.ctas, order.factor, dims, PADDING,
                                           False, probe)

            mean_ok = tensors_equal(fused(3), x.movedim(1, -1).to(torch.float32).pow(2).mean(-1).reshape(b, -1))
            buffer_ok = tensors_equal(fused(), before())
            t_fused = _time(fused, args.repeats) * 1e3
            out_bytes = x.numel() * (shape[2] + 2) // shape[2] * x.element_size()
            gbs = (2 * x.numel() * x.element_size() + out_bytes) / t_fused / 1e3
            saved += (t_before - t_fused) * calls
            print(f"{line} rows {order.rows:3d} x ctas {order.ctas:2d}: mean {'ok' if mean_ok else 'DIFFERS'}, "
                  f"buffer {'ok' if buffer_ok else 'DIFFERS'}; before {t_before:8.1f} us, fused {t_fused:8.1f} us "
                  f"({gbs:6.0f} GB/s)")
        print(f"{dname}: the fused kernel saves about {saved / 1e3:.2f} ms of chains per decode against the path before")


if __name__ == "__main__":
    main()
