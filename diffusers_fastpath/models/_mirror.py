"""Guard for the few diffusers methods this package mirrors.

A mirrored method (a block's ``forward``, an attention processor's ``__call__``) is a copy of diffusers' code with
one change: an elementwise chain routed through a fused op. It is only bit-identical while diffusers' original
is the code it was copied from, so the adapter checks the installed diffusers' source against the hash of the
version it mirrors and leaves that part unpatched, with one warning, when they differ.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap

from .._logging import logger
from ._chain_proofs import source_of


def source_digest(fn) -> str | None:
    """The digest of `fn`'s source, or None where that source is not provably `fn`'s (`source_of`: a
    ``functools.wraps`` wrapper, whose ``inspect.getsource`` is the wrapped function's; a function replaced, or its
    file edited since the import)."""
    source, _ = source_of(fn)
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()[:16]


def normalized_digest(fn_or_def) -> str | None:
    """sha256[:16] of ``ast.unparse`` of a function's definition with its name set aside: the same for a copy of a
    function under another name, different for any change of its code (comments and layout aside)."""
    if isinstance(fn_or_def, ast.FunctionDef):
        node = fn_or_def
    else:
        try:
            (node,) = ast.parse(textwrap.dedent(inspect.getsource(fn_or_def))).body
        except (OSError, TypeError, ValueError, SyntaxError):
            return None
        if not isinstance(node, ast.FunctionDef):
            return None
    node = ast.FunctionDef(name="_", args=node.args, body=node.body, decorator_list=[], returns=node.returns,
                           type_comment=None, type_params=getattr(node, "type_params", []))
    return hashlib.sha256(ast.unparse(ast.fix_missing_locations(node)).encode()).hexdigest()[:16]


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
