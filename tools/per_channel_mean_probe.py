"""LTX-2's VAE norm with aten's channel mean in the kernel (ops/per_channel_rmsnorm.py), shape by shape on this GPU.

For each norm shape of LTX-2's VAE on a 768x512x121 video (the decoder's and the encoder's) and each dtype: the order
`mean_order` derives here (rows x ctas partial sums, or why aten's mean is kept), the fused kernel's mean (probe mode
3) against ``torch.mean(x**2, dim=1)`` bit for bit, the norm and the pair against the eager module, and the median
time of eager, of the op's path before (aten's square and mean, then the tail kernel) and of the fused kernel, with
the fused kernel's GB/s over x read twice and out written once.

    python tools/per_channel_mean_probe.py [--dtypes bf16,fp16,fp32] [--repeats 20]
"""

from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import PerChannelRMSNorm

from diffusers_fastpath.ops._policy import tensors_equal
from measure_stores import _time  # (tools/: median ms of CUDA-event timed calls)

pcr = importlib.import_module("diffusers_fastpath.ops.per_channel_rmsnorm")

SHAPES = {  # [B, C, T, H, W] -> norms per decode / encode
    "decoder 1024": ((1, 1024, 16, 16, 24), 10), "decoder 512": ((1, 512, 31, 32, 48), 10),
    "decoder 256": ((1, 256, 61, 64, 96), 10), "decoder 128": ((1, 128, 121, 128, 192), 11),
    "encoder 2048": ((1, 2048, 16, 16, 24), 5), "encoder 1024": ((1, 1024, 31, 32, 48), 4),
    "encoder 512": ((1, 512, 61, 64, 96), 12), "encoder 256": ((1, 256, 121, 64, 96), 12),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-8


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, {props.max_threads_per_multi_processor} threads each; "
          f"torch {torch.__version__}")
    norm = PerChannelRMSNorm()
    saved = {}
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for name, (shape, calls) in SHAPES.items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
            b, c = shape[:2]
            x3 = x.reshape(b, c, -1)
            order = pcr.mean_order(x)
            eps = pcr.eps_as_added(EPS, dtype, x.device)
            eager = norm(x)
            pair = F.silu(eager)

            def before(silu=False):
                mean = torch.mean(x**2, dim=1, keepdim=True).reshape(b, -1)
                return pcr._launch(x3, mean, eps, silu, 0)

            line = f"{dname} {name:13s} {str(shape):24s}"
            t_eager = _time(lambda: norm(x), args.repeats) * 1e3
            t_before = _time(before, args.repeats) * 1e3
            if type(order) is not pcr.MeanOrder:
                print(f"{line} aten's mean ({order}); eager {t_eager:8.1f} us, before {t_before:8.1f} us")
                continue
            mean = pcr._launch_fused(x3, eps, False, order.rows, order.ctas, order.factor, pcr.PROBE_MEAN)
            mean_ok = tensors_equal(mean, torch.mean(x**2, dim=1).reshape(b, -1))
            norm_ok = tensors_equal(pcr._launch_fused(x3, eps, False, *order, 0).view(x.shape), eager)
            pair_ok = tensors_equal(pcr._launch_fused(x3, eps, True, *order, 0).view(x.shape), pair)
            t_fused = _time(lambda: pcr._launch_fused(x3, eps, False, *order, 0), args.repeats) * 1e3
            gbs = 3 * x.numel() * x.element_size() / t_fused / 1e3
            saved[(dname, name)] = (t_before - t_fused) * calls
            print(f"{line} rows {order.rows:3d} x ctas {order.ctas:2d}: mean {'ok' if mean_ok else 'DIFFERS'}, "
                  f"norm {'ok' if norm_ok else 'DIFFERS'}, pair {'ok' if pair_ok else 'DIFFERS'}; eager "
                  f"{t_eager:8.1f} us, before {t_before:8.1f} us, fused {t_fused:8.1f} us ({gbs:6.0f} GB/s)")
    for dname in args.dtypes.split(","):
        decode = sum(v for (d, n), v in saved.items() if d == dname and n.startswith("decoder")) / 1e3
        print(f"{dname}: the fused kernel saves {decode:.2f} ms of norms per decode against the path before")


if __name__ == "__main__":
    main()
