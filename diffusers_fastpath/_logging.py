"""The package logger, a child of diffusers' own (`diffusers.utils.logging.set_verbosity_*` applies to it), and
`warn_once`: every warning of this package is printed once per process."""

from diffusers.utils import logging

logger = logging.get_logger("diffusers.fastpath")

_warned: set[str] = set()


def warn_once(msg: str) -> None:
    """``logger.warning(msg)`` the first time this process sees `msg`; later calls with the same text are silent."""
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)
