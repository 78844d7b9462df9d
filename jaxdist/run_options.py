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
        donate_argnums: donate only these positional arguments (indices into
            the arguments the function is called with, after the replica
            context; an int or a tuple), as ``jax.jit(donate_argnums=...)``: a
            step that feeds back its parameters and optimizer state but reuses
            its batch donates ``(0, 1)``. Not together with ``donate_args``.
        experimental_xla_options: XLA compiler options passed to `jax.jit`
            as ``compiler_options`` (for example
            ``{"xla_cpu_enable_fast_math": False}``).
    """

    donate_args: bool = False
    experimental_xla_options: tuple[tuple[str, Any], ...] | Mapping[str, Any] | None = None
    donate_argnums: int | tuple[int, ...] = ()

    def __post_init__(self) -> None:
        nums = self.donate_argnums
        nums = (nums,) if isinstance(nums, int) and not isinstance(nums, bool) else nums
        if not isinstance(nums, (tuple, list)) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in nums
        ):
            raise TypeError(
                "RunOptions(donate_argnums=...) must be an int >= 0 or a tuple of them (the "
                f"positions of the arguments to donate, after ctx), got {self.donate_argnums!r}."
            )
        object.__setattr__(self, "donate_argnums", tuple(sorted(set(nums))))
        if self.donate_args and self.donate_argnums:
            raise ValueError(
                "RunOptions: give donate_args=True (every argument) or donate_argnums (some), "
                "not both."
            )
        xla = self.experimental_xla_options
        if isinstance(xla, Mapping):
            object.__setattr__(self, "experimental_xla_options", tuple(sorted(xla.items())))
        elif xla is not None and not isinstance(xla, tuple):
            raise TypeError(
                "RunOptions(experimental_xla_options=...) must be a mapping of XLA option "
                f"names to values, got {type(xla).__name__}."
            )
