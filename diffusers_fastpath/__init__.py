"""diffusers_fastpath: faster diffusers pipelines with bit-identical output.

>>> import diffusers_fastpath as fp
>>> fp.patch(pipe)            # doctest: +SKIP
>>> print(fp.report(pipe))    # doctest: +SKIP
>>> fp.unpatch(pipe)          # doctest: +SKIP
"""

from .patching import patch, supported_classes, unpatch
from .report import Report, report

__version__ = "0.1.0"

__all__ = ["patch", "unpatch", "report", "Report", "supported_classes", "__version__"]
