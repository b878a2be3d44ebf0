import math

import numpy as np
import pytest
import torch

from diffusers_fastpath.metrics import psnr, ssim


def test_identical_images():
    img = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert psnr(img, img) == math.inf
    assert ssim(img, img) == pytest.approx(1.0, abs=1e-12)


def test_psnr_matches_its_definition():
    gen = torch.Generator().manual_seed(1)
    a = torch.rand(2, 3, 16, 16, generator=gen)
    noise = torch.randn(a.shape, generator=gen) * 0.01
    b = a + noise
    expected = 10 * math.log10(1.0 / (b.double() - a.double()).pow(2).mean().item())
    assert psnr(a, b) == pytest.approx(expected, rel=1e-9)


def test_ssim_drops_with_noise_and_is_symmetric():
    gen = torch.Generator().manual_seed(2)
    a = torch.rand(3, 64, 64, generator=gen)
    small = (a + 0.01 * torch.randn(a.shape, generator=gen)).clamp(0, 1)
    large = (a + 0.2 * torch.randn(a.shape, generator=gen)).clamp(0, 1)
    assert 1.0 > ssim(a, small) > ssim(a, large)
    assert ssim(a, small) == pytest.approx(ssim(small, a), rel=1e-12)


def test_ssim_is_the_2d_gaussian_window_of_the_reference_and_a_video_is_its_frames():
    """The separable, chunked windows give the reference's 2-D Gaussian "valid" windows (to rounding), and a
    channels-last video (batch, frames, H, W, C) is the mean over its frames and channels, more than one chunk of them."""
    gen = torch.Generator().manual_seed(4)
    a = torch.rand(2, 7, 3, 20, 26, generator=gen, dtype=torch.float64)
    b = (a + 0.05 * torch.randn(a.shape, generator=gen, dtype=torch.float64)).clamp(0, 1)
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    g = g / g.sum()
    blur = lambda x: torch.nn.functional.conv2d(x.reshape(-1, 1, 20, 26), (g[:, None] * g[None, :])[None, None])  # noqa: E731
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2, blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    reference = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    assert ssim(a, b) == pytest.approx(reference.mean().item(), rel=1e-12)
    video_a, video_b = a.permute(0, 1, 3, 4, 2).numpy(), b.permute(0, 1, 3, 4, 2).numpy()
    frames = [ssim(a[i, f], b[i, f]) for i in range(2) for f in range(7)]
    assert ssim(video_a, video_b) == pytest.approx(sum(frames) / len(frames), rel=1e-12)


def test_numpy_uint8_and_pil_layouts():
    from PIL import Image

    gen = np.random.default_rng(3)
    a = gen.integers(0, 256, (24, 24, 3), dtype=np.uint8)
    b = a.copy()
    b[0, 0, 0] ^= 1
    ta = torch.from_numpy(a).double().permute(2, 0, 1) / 255
    tb = torch.from_numpy(b).double().permute(2, 0, 1) / 255
    assert psnr(a, b) == pytest.approx(psnr(ta, tb), rel=1e-12)
    assert psnr(Image.fromarray(a), Image.fromarray(b)) == pytest.approx(psnr(ta, tb), rel=1e-12)
    assert ssim(a, b) == pytest.approx(ssim(ta, tb), rel=1e-12)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(torch.zeros(3, 4, 4), torch.zeros(3, 4, 5))
