"""diffusers_fastpath: faster diffusers pipelines with bit-identical output.

>>> import diffusers_fastpath as fp
>>> fp.patch(pipe)            # doctest: +SKIP
>>> with fp.quality(pipe, "high"):  # doctest: +SKIP
...     image = pipe(prompt).images[0]
>>> print(fp.report(pipe))    # doctest: +SKIP
>>> fp.unpatch(pipe)          # doctest: +SKIP
"""

from .patching import patch, supported_classes, unpatch
from .quality import quality
from .report import Report, report

__version__ = "0.1.0"

__all__ = ["patch", "unpatch", "quality", "report", "Report", "supported_classes", "__version__"]
