"""The one fallback policy that every fused op follows.

- A *guard* decides per call whether the fused kernel can take these inputs. When it cannot, the eager reference
  runs and the result is still exact; the reason is counted at the call site.
- The first exception from a fused kernel (a failed build, a launch error) logs one warning and disables that op
  for the process; its calls run the eager reference from then on.
- Inside ``torch.compile`` tracing nothing is swallowed: the op is emitted as its registered custom op (with a fake
  implementation), and any error is raised. A fallback baked into a graph would lose the fast path for good.
- Every call site counts its fast calls and its fallbacks with their reasons, which `diffusers_fastpath.report`
  shows.

Set ``DIFFUSERS_FASTPATH_DISABLE=1`` to send every fused op to its eager reference (an A/B switch that needs no
code change; `report` then says why).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Callable

import torch

from .._logging import logger

ENV_DISABLE = "DIFFUSERS_FASTPATH_DISABLE"
REASON_ENV = f"{ENV_DISABLE} is set"
REASON_DISABLED = "op disabled after an error"


def _env_disabled() -> bool:
    return os.environ.get(ENV_DISABLE, "").strip().lower() in ("1", "true", "yes", "on")


class Site:
    """Counters of one call site of a fused op: calls that took the fast path, and fallbacks by reason."""

    __slots__ = ("op", "fast", "fallback")

    def __init__(self, op: str) -> None:
        self.op = op
        self.fast = 0
        self.fallback: Counter[str] = Counter()

    def reset(self) -> None:
        self.fast = 0
        self.fallback.clear()

    def __repr__(self) -> str:
        return f"Site(op={self.op!r}, fast={self.fast}, fallback={dict(self.fallback)})"


class FusedOp:
    """A fused kernel with its guard, its eager reference and its registered custom op.

    Args:
        name: the op's name (``diffusers_fastpath::<name>``).
        ref: the eager PyTorch expression the kernel reproduces bit for bit.
        guard: ``guard(*args, check_pointers=True) -> str | None``: ``None`` if the kernel takes these inputs,
            else a short reason. Pointer checks are skipped while tracing (fake tensors have no storage).
        kernel: the eager fast path (calls the CUDA extension directly, without the Python custom-op layer).
        custom_op: the registered ``torch.library`` op that ``torch.compile`` sees.
    """

    def __init__(
        self,
        name: str,
        *,
        ref: Callable[..., torch.Tensor],
        guard: Callable[..., str | None],
        kernel: Callable[..., torch.Tensor],
        custom_op: Callable[..., torch.Tensor],
    ) -> None:
        self.name = name
        self.ref = ref
        self.guard = guard
        self.kernel = kernel
        self.custom_op = custom_op
        self.disabled: str | None = None  # why the op was disabled for this process, if it was
        self.env_disabled = _env_disabled()
        OPS[name] = self

    def __call__(self, site: Site | None, *args: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # No try/except here: an error while tracing or running the compiled graph is raised, never swallowed.
            if self.disabled is None and not self.env_disabled and self.guard(*args, check_pointers=False) is None:
                return self.custom_op(*args)
            return self.ref(*args)

        if self.env_disabled:
            reason = REASON_ENV
        elif self.disabled is not None:
            reason = REASON_DISABLED
        else:
            reason = self.guard(*args)
            if reason is None:
                try:
                    out = self.kernel(*args)
                except Exception as exc:  # noqa: BLE001 - any kernel failure falls back, once, loudly
                    self.disable(exc)
                    reason = REASON_DISABLED
                else:
                    if site is not None:
                        site.fast += 1
                    return out
        if site is not None:
            site.fallback[reason] += 1
        return self.ref(*args)

    def disable(self, exc: BaseException) -> None:
        """Turn the fast path off for this process after `exc`, with one warning."""
        self.disabled = f"{type(exc).__name__}: {exc}".strip()
        logger.warning(
            f"diffusers_fastpath: disabling the fused op '{self.name}' for this process; its calls now run the "
            f"eager PyTorch expression (same numbers, slower). Cause: {self.disabled}"
        )

    def reset(self) -> None:
        """Re-enable the op (after fixing what disabled it) and re-read the environment switch."""
        self.disabled = None
        self.env_disabled = _env_disabled()

    @property
    def status(self) -> str:
        if self.env_disabled:
            return REASON_ENV
        if self.disabled is not None:
            return f"disabled ({self.disabled})"
        return "enabled"


OPS: dict[str, FusedOp] = {}
