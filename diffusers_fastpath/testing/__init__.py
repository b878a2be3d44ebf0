"""Models built from published configs with random weights (no downloads), for tests, examples and benchmarks, and
the checks every family's tests run on them.

Bit-exactness holds for any weights, so a model built from the published config with random weights measures
the real shapes and the real speed; `randomize_` makes sure no parameter is left at a zero or identity init
(a fused path fed zeros proves nothing).

One import for all of it (``from diffusers_fastpath.testing import build_flux_transformer, ...``), in four parts:
`checks` (the assertions), `flux` (FLUX.1, Chroma, the FLUX clones, FLUX.2, their VAEs and pipelines),
`families` (every other family), `_common` (what the builders share).
"""

from ._common import randomize_  # noqa: F401
from .checks import *  # noqa: F401,F403
from .families import *  # noqa: F401,F403
from .flux import *  # noqa: F401,F403
