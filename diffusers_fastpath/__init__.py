"""diffusers_fastpath: faster diffusers pipelines with bit-identical output.

`patch` swaps the elementwise chains and normalisations of a pipeline's diffusion transformer for fused CUDA
kernels that round exactly as eager PyTorch does, so the output is ``torch.equal`` to unpatched diffusers;
`unpatch` restores every class, processor and hook. `quality` runs a ``with`` block at the opt-in approximate
tier, `report` says which sites ran fused and why others fell back, `supported_classes` lists the classes a family
adapter covers and `coverage` how each of diffusers' model classes is taken (a family adapter, or the generic path
that verifies a model's first forward).
The kernels run on CUDA in bf16 and fp16; anywhere else every site runs diffusers' own expression (the same
numbers, no speed-up). README.md is the user's guide.

>>> import diffusers_fastpath as fp
>>> fp.patch(pipe)            # doctest: +SKIP
>>> image = pipe(prompt).images[0]  # doctest: +SKIP
>>> with fp.quality(pipe, "high"):  # doctest: +SKIP
...     image = pipe(prompt).images[0]
>>> print(fp.report(pipe))    # doctest: +SKIP
>>> fp.unpatch(pipe)          # doctest: +SKIP
"""

from .patching import UnsupportedModelError, coverage, patch, supported_classes, unpatch
from .quality import quality
from .report import Report, report

__version__ = "0.1.0"

__all__ = ["patch", "unpatch", "quality", "report", "Report", "supported_classes", "coverage", "UnsupportedModelError",
           "__version__"]
