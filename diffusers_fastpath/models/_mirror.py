"""Guard for the few diffusers methods this package mirrors.

A mirrored method (a block's ``forward``, an attention processor's ``__call__``) is a copy of diffusers' code with
one change: an elementwise chain routed through a fused op. It is only bit-identical while diffusers' original
is the code it was copied from, so the adapter checks the installed diffusers' source against the hash of the
version it mirrors and leaves that part unpatched, with one warning, when they differ.
"""

from __future__ import annotations

import functools

from .._logging import logger
from .._source import source_digest


@functools.cache
def mirrors(fn, digest: str) -> bool:
    """True if the installed ``fn`` is the code (by ``digest``) that the mirrored copy was made from."""
    found = source_digest(fn)
    if found == digest:
        return True
    logger.warning(
        f"diffusers_fastpath: the installed diffusers' {fn.__qualname__} is not the version this package mirrors "
        f"(source digest {found}, expected {digest}); leaving it unpatched so the output stays exact."
    )
    return False
