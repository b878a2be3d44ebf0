"""One adapter per diffusers model family, registered by model class with `patching.register_adapter`."""

from . import bria_fibo2, chroma, ernie_image, flux, flux2, flux_clones, hunyuan, lumina2, ltx, qwenimage, qwenimage21, sd3, vae_hunyuan, vae_kl, vae_ltx, vae_ltx2, vae_wan, wan, zimage  # noqa: F401  (register their model classes)
