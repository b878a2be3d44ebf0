"""One adapter per diffusers model family, registered by model class with `patching.register_adapter`."""

from . import flux  # noqa: F401  (registers FluxTransformer2DModel)
