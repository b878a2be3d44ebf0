"""Guard for the few diffusers methods this package mirrors.

A mirrored method (a block's ``forward``, an attention processor's ``__call__``) is a copy of diffusers' code with
one change: an elementwise chain routed through a fused op. It is only bit-identical while diffusers' original
is the code it was copied from, so the adapter checks the installed diffusers' source against the hash of the
version it mirrors and leaves that part unpatched, with one warning, when they differ.
"""

from __future__ import annotations

import functools
import hashlib

from .._logging import logger
from ._chain_proofs import source_of


def source_digest(fn) -> str | None:
    """The digest of `fn`'s source, or None where that source is not provably `fn`'s (`source_of`: a
    ``functools.wraps`` wrapper, whose ``inspect.getsource`` is the wrapped function's; a function replaced, or its
    file edited since the import)."""
    source, _ = source_of(fn)
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()[:16]


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
