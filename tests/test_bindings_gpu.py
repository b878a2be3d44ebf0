"""The raw CUDA ops (csrc/bindings.cpp's ``_*_cuda``) called directly with input their checks refuse: each raises a
RuntimeError naming the problem, none crashes. The Python guards never hand them such input; a direct call must still
not take the process down (on the H200 image every check whose message formatted a number or a shape through an
ostream segfaulted). Each call runs in its own interpreter, so a crash fails its case instead of the test worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

# (op, arguments as tensor shapes (bf16 on the GPU; "f32:" for float32), the message the check gives)
CASES = {
    "modulate-2d-x": ("_modulate_scale_shift_cuda", [(65, 4104), (1, 4104), (1, 4104)], "got [65, 4104]"),
    "modulate-odd-width": ("_modulate_scale_shift_cuda", [(1, 65, 4100), (1, 4100), (1, 4100)], "multiple of 8"),
    "modulate-scale-width": ("_modulate_scale_shift_cuda", [(1, 65, 4104), (1, 4096), (1, 4096)], "got [1, 4096]"),
    "modulate-fp32": ("_modulate_scale_shift_cuda", ["f32:1,65,64", "f32:1,64", "f32:1,64"], "got Float"),
    "layernorm-odd-width": ("_layernorm_scale_shift_cuda", [(1, 65, 4100), (1, 4100), (1, 4100), 1e-6],
                            "multiple of 8"),
    "layernorm-affine-matrix-weight": ("_layernorm_affine_fp32_cuda", [(1, 65, 64), "f32:2,64", "f32:2,64", 1e-6],
                                       "[dim] vectors"),
    "layernorm-modulate-rows-shape": ("_layernorm_modulate_cuda",
                                      [(1, 65, 64), (1, 64, 64), (1, 65, 64), "f32:64", "f32:64", 1e-6],
                                      "got [1, 64, 64]"),
    "layernorm-modulate-bf16-weight": ("_layernorm_modulate_cuda", [(1, 65, 64), (1, 65, 64), (1, 1, 64), (64,), (64,),
                                                                    1e-6], "float32 [dim] rows"),
    "gated-residual-odd-width": ("_gated_residual_cuda", [(1, 65, 4100), (1, 1, 4100), (1, 65, 4100)],
                                 "multiple of 8"),
    "gated-residual-gate-shape": ("_gated_residual_cuda", [(1, 65, 64), (1, 2, 64), (1, 65, 64)], "got [1, 2, 64]"),
    "cat-heads-head-mismatch": ("_cat_heads_cuda", [(1, 24, 65, 64), (1, 12, 8, 64)],
                                "got [1, 24, 65, 64] and [1, 12, 8, 64]"),
    "cat-heads-odd-width": ("_cat_heads_cuda", [(1, 24, 65, 60), (1, 24, 8, 60)], "whole vectors"),
    "gelu-cat-seq-mismatch": ("_gelu_cat_cuda", [(1, 65, 64), (1, 64, 256)], "got [1, 65, 64] and [1, 64, 256]"),
    "rmsnorm-scale-odd-width": ("_rmsnorm_scale_cuda", [(1, 65, 4100), (4100,), (1, 65, 4100), 1e-6],
                                "multiple of 128"),
    "rmsnorm-modulate-rows": ("_rmsnorm_modulate_cuda", [(1, 65, 2048), (2048,), (1, 64, 2048), (1, 65, 2048), 1e-6],
                              "must be [seq, batch, dim]"),
    "rotary-3d-x": ("_rotary_emb_cuda", [(1, 65, 64), "f32:65,64", "f32:65,64"], "got [1, 65, 64]"),
    "rotary-rows-table-batch": ("_rotary_emb_rows_cuda", [(2, 65, 256), "f32:3,65,256", "f32:3,65,256", 128],
                                "take one source (or the row norm's pair) without norm"),
    "rotary-wan-table-shape": ("_rotary_emb_wan_cuda", [(1, 65, 4, 64), "f32:1,65,1,64", "f32:1,65,1,64"],
                               "must be [seq, dim]"),
    "rotary-rows-head-dim": ("_rotary_emb_rows_cuda", [(2, 65, 256), "f32:2,65,256", "f32:2,65,256", 96],
                             "got [2, 65, 256]"),
    "per-channel-rmsnorm-fp32-mean": ("_per_channel_rmsnorm_cuda", [(2, 16, 96), "f32:2,96", 1e-8, False, 0],
                                      "mean must be a contiguous [B, 1, S] tensor of x's dtype"),
    "per-channel-rmsnorm-probe-silu": ("_per_channel_rmsnorm_cuda", [(1, 1, 64), (1, 64), 1e-8, True, 1],
                                       "probe must be 0, 1 or 2"),
    "per-channel-rmsnorm-pad-cl-dims": ("_per_channel_rmsnorm_pad_cl_cuda",
                                        [(1, 4, 24), 1e-8, True, 1, 1, 0.25, [2, 3, 3], [1, 1, 1, 1, 1, 1], True],
                                        "dims must be x's (frames, height, width)"),
    "per-channel-rmsnorm-pad-cl-reflect-too-wide": ("_per_channel_rmsnorm_pad_cl_cuda",
                                                    [(1, 4, 24), 1e-8, True, 1, 1, 0.25, [2, 3, 4],
                                                     [4, 4, 1, 1, 1, 1], True],
                                                    "a reflected padding must be below its axis' size"),
    "per-channel-rmsnorm-cl-pad-cl-contiguous-x": ("_per_channel_rmsnorm_cl_pad_cl_cuda",
                                                   [(1, 16, 3, 4, 5), (16,), 1e-8, True, 1, 1, 1 / 16,
                                                    [1, 1, 1, 1, 2, 0], True], "laid out channels_last_3d"),
    "per-channel-rmsnorm-cl-pad-cl-narrow": ("_per_channel_rmsnorm_cl_pad_cl_cuda",
                                             [(1, 4, 1, 1, 1), (4,), 1e-8, True, 1, 1, 0.25, [0, 0, 0, 0, 2, 0],
                                              False], "multiple of 16 bytes"),
    "per-channel-rmsnorm-cl-pad-cl-bias": ("_per_channel_rmsnorm_cl_pad_cl_cuda",
                                           [(1, 16, 1, 1, 1), (8,), 1e-8, True, 1, 1, 1 / 16, [0, 0, 0, 0, 2, 0],
                                            False], "bias must be a contiguous [C]"),
    "ltx-rmsnorm-two-modes": ("_ltx_rmsnorm_cuda", [(2, 16, 96), None, True, True, False],
                              "at most one of square, silu and probe"),
    "ltx-rmsnorm-silu-without-rsqrt": ("_ltx_rmsnorm_cuda", [(2, 16, 96), None, False, True, False],
                                       "rsqrt must be a contiguous fp32"),
    # (None and a list passed as they are: the optional cache, the padding)
    "causal-pad-reflect-too-wide": ("_causal_pad_cuda", [(1, 4, 3, 2, 5), None, [1, 1, 2, 2, 1, 1], True, True, True],
                                    "below the size of its dimension"),
    "conv-bias-residual-x-layout": ("_conv_bias_residual_contiguous_cuda", [(1, 16, 3, 4, 5), (16,), (1, 16, 3, 4, 5)],
                                    "x must be a channels-last CUDA"),
    # (x of one position: contiguous and channels-last at once)
    "conv-bias-residual-shape": ("_conv_bias_residual_contiguous_cuda", [(1, 16, 1, 1, 1), (16,), (1, 8, 1, 1, 1)],
                                 "residual must be a contiguous tensor of x's sizes"),
    "conv-bias-depth-to-space-x-layout": ("_conv_bias_depth_to_space_cuda", [(1, 64, 3, 4, 5), (64,), (1, 16, 3, 4, 5)],
                                          "x must be a 16-byte aligned channels-last CUDA"),
    # (x of one position: contiguous and channels-last at once; 3 residual groups do not divide its 8 channels)
    "conv-bias-depth-to-space-residual": ("_conv_bias_depth_to_space_cuda", [(1, 64, 1, 1, 1), (64,), (1, 24, 1, 1, 1)],
                                          "residual must be a contiguous [N, 8 G, T, H, W]"),
    "causal-pad-nothing-to-repeat": ("_causal_pad_cuda", [(1, 4, 0, 2, 5), None, [0, 0, 0, 0, 2, 0], False, True,
                                                          False], "need a frame to repeat"),
}

SCRIPT = """
import sys, torch
from diffusers_fastpath.ops._build import load_extension
assert load_extension() == "nvcc"
def arg(a):
    if a is None or isinstance(a, (int, float, list)):
        return a
    if isinstance(a, str):
        return torch.randn(*map(int, a[4:].split(",")), device="cuda")
    return torch.randn(*a, device="cuda").bfloat16()
op, args = sys.argv[1], eval(sys.argv[2])
try:
    getattr(torch.ops.diffusers_fastpath, op)(*map(arg, args))
except RuntimeError as e:
    print("RAISED", str(e).splitlines()[0])
else:
    print("NO ERROR")
"""


@pytest.mark.parametrize("case", CASES)
def test_raw_op_with_refused_input_raises_instead_of_crashing(case):
    from diffusers_fastpath.ops import _build

    if _build.load_extension() != "nvcc":
        pytest.skip("the bindings are the nvcc build's (the NVRTC way checks in Python)")
    op, args, message = CASES[case]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, op, repr(args)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 0, f"{op} crashed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
    line = next(line for line in proc.stdout.splitlines() if line.startswith(("RAISED", "NO ERROR")))
    assert line.startswith("RAISED") and message in line, line
