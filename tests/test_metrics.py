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
