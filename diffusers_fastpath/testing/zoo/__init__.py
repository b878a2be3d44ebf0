"""A zoo of the diffusers 0.42.1 DiT classes that no family adapter covered at ed203a0: each buildable tiny on CPU
(or at its published size on a GPU) with random weights, and fed fresh random inputs as its pipeline passes them.

What the generic adapter (issue 39) is tested and benched on. One entry per class of ``COVERAGE.md``'s "Uncovered"
table, keyed by a short model name; the entries live by family group in `wan` (Wan's siblings), `video`, `image`,
`classic` (the 2023-2024 BasicTransformerBlock / CogVideoX era) and `audio`. `PIPELINES` (`pipelines`): the classes'
own diffusers pipelines that build offline, tiny, without text encoders.

Example:
    >>> import torch
    >>> from diffusers_fastpath.testing import zoo
    >>> model = zoo.build("wan-vace")                       # tiny, bf16, CPU, every parameter random
    >>> kwargs = zoo.inputs("wan-vace", model, batch=2)     # fresh random inputs, as WanVACEPipeline passes them
    >>> with torch.no_grad():
    ...     out = model(**kwargs)[0]
    >>> sorted(zoo.ZOO)[:3]
    ['ace-step', 'allegro', 'anyflow']

Weights: built straight in the requested dtype (as ``from_pretrained(torch_dtype=...)`` builds), every state-dict
tensor then in the dtype ``from_pretrained`` loads it in (fp32 for the class's ``_keep_in_fp32_modules``), and every
parameter drawn by `randomize_` (zero-initialised gates, output layers and convolutions included, so every path
runs).
"""

from __future__ import annotations

from ._entry import Draw, ZooEntry  # noqa: F401
from ._zoo import ZOO, _as_loaded_, build, inputs  # noqa: F401
from .image import kv_cached_steps  # noqa: F401
from .pipelines import PIPELINES

__all__ = ["ZOO", "ZooEntry", "Draw", "build", "inputs", "PIPELINES"]
