"""`RunOptions`: per-call options of `Strategy.run`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["RunOptions"]


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for `Strategy.run` and `Strategy.function`.

    Attributes:
        donate_args: let XLA reuse the argument buffers for outputs (as
            ``jax.jit(donate_argnums=...)``); donated arrays must not be used
            again by the caller. The valid-row counts of `PerReplica` batches
            are never donated (a distributed dataset's batches share them).
        experimental_xla_options: XLA compiler options passed to `jax.jit`
            as ``compiler_options`` (for example
            ``{"xla_cpu_enable_fast_math": False}``).
    """

    donate_args: bool = False
    experimental_xla_options: tuple[tuple[str, Any], ...] | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        xla = self.experimental_xla_options
        if isinstance(xla, Mapping):
            object.__setattr__(self, "experimental_xla_options", tuple(sorted(xla.items())))
        elif xla is not None and not isinstance(xla, tuple):
            raise TypeError(
                "RunOptions(experimental_xla_options=...) must be a mapping of XLA option "
                f"names to values, got {type(xla).__name__}."
            )
