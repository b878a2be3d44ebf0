"""Image-quality metrics for the approximate tier and the benchmark: PSNR and SSIM between two images.

Images are tensors (or numpy arrays / PIL images, converted) with values in [0, 1], laid out ``[..., C, H, W]``
for tensors; numpy and PIL images (``H, W, C`` in 0..255) are converted. Both functions work in float64 on the
CPU so that the numbers do not depend on the device that produced the images.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _as_tensor(img: Any) -> torch.Tensor:
    if isinstance(img, torch.Tensor):
        return img.detach().to("cpu", torch.float64)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        np = None
    if np is not None and not isinstance(img, np.ndarray):
        img = np.asarray(img)  # PIL image -> (H, W, C) uint8
    if np is not None and isinstance(img, np.ndarray):
        scale = 255.0 if img.dtype == np.uint8 else 1.0
        t = torch.from_numpy(np.ascontiguousarray(img)).to(torch.float64) / scale
        if t.dim() == 2:
            t = t[..., None]
        return t.movedim(-1, -3)  # (..., H, W, C) -> (..., C, H, W)
    raise TypeError(f"expected a tensor, a numpy array or a PIL image, got {type(img).__name__}")


def psnr(a: Any, b: Any, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB (``inf`` for identical images)."""
    a, b = _as_tensor(a), _as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"psnr: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    mse = torch.mean((a - b) ** 2).item()
    return math.inf if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


def _blur(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The Gaussian window's "valid" mean of each (..., H, W) image, separably: rows then columns, as sums of shifted
    slices (no unfolded copy: a video's frames stay within a few times their own size)."""
    w = g.numel()
    rows = sum(g[k] * x[..., k:x.shape[-2] - w + 1 + k, :] for k in range(w))
    return sum(g[k] * rows[..., k:rows.shape[-1] - w + 1 + k] for k in range(w))


def ssim(a: Any, b: Any, data_range: float = 1.0, window: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity (Wang et al. 2004: Gaussian window 11, sigma 1.5, K1=0.01, K2=0.03), averaged
    over channels and images (a video's frames are images); 1.0 for identical images. Computed a few images at a time,
    so a 121-frame 768x512 video needs about a gigabyte of host memory."""
    a, b = _as_tensor(a), _as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"ssim: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a = a.reshape(-1, *a.shape[-2:])
    b = b.reshape(-1, *b.shape[-2:])
    window = min(window, a.shape[-1], a.shape[-2])
    coords = torch.arange(window, dtype=torch.float64) - (window - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    total, count = 0.0, 0
    for i in range(0, a.shape[0], 8):
        x, y = a[i:i + 8], b[i:i + 8]
        mu_a, mu_b = _blur(x, g), _blur(y, g)
        var_a = _blur(x * x, g) - mu_a**2
        var_b = _blur(y * y, g) - mu_b**2
        cov = _blur(x * y, g) - mu_a * mu_b
        s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
        total, count = total + s.sum().item(), count + s.numel()
    return total / count
