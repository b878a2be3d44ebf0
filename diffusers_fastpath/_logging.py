"""The package logger, a child of diffusers' own (`diffusers.utils.logging.set_verbosity_*` applies to it)."""

from diffusers.utils import logging

logger = logging.get_logger("diffusers.fastpath")
