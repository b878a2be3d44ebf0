"""``python -m diffusers_fastpath.bench``: see the package docstring, or ``--help``."""

import sys

from .cli import main

sys.exit(main())
