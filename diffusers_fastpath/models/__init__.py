"""One adapter per diffusers model family, registered by model class with `patching.register_adapter`."""

from . import ernie_image, flux  # noqa: F401  (register ErnieImageTransformer2DModel, FluxTransformer2DModel)
