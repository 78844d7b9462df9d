"""What a variable is besides its value: TF's synchronization and aggregation
enums, the per-variable metadata, colocation, and where each kind of variable lives."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Iterator
from typing import Any

import jax

from jaxdist._protocols import StrategyLike


class _NamedEnum(enum.Enum):
    @classmethod
    def from_any(cls, value: Any, *, where: str) -> Any:
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        names = ", ".join(cls.__members__)
        raise ValueError(f"{where}: unknown {cls.__name__} {value!r}; use one of {names}.")


class VariableSynchronization(_NamedEnum):
    """When a distributed variable's copies are made consistent."""

    AUTO = "AUTO"
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"


class VariableAggregation(_NamedEnum):
    """How per-replica updates (``ON_WRITE``) or copies (``ON_READ``) combine."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


@dataclasses.dataclass(frozen=True)
class Meta:
    synchronization: VariableSynchronization
    aggregation: VariableAggregation
    trainable: bool
    name: str | None
    strategy: StrategyLike  # the strategy that placed it
    created_in_scope: bool
    local: bool = False  # True for the per-replica view inside a replica function


# The Variable to colocate new variables with, or None.
COLOCATE: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxdist_colocate", default=None)


@contextlib.contextmanager
def colocate_with(var: Any) -> Iterator[None]:
    """Variables created in the block are placed on ``var``'s devices (private)."""
    token = COLOCATE.set(var)
    try:
        yield
    finally:
        COLOCATE.reset(token)


def mirrored_sharding(strategy: StrategyLike) -> jax.sharding.Sharding:
    param = getattr(strategy, "parameter_device", None)
    if param is not None:
        return jax.sharding.SingleDeviceSharding(param)
    return strategy.replicated_sharding


def replica_sharding(strategy: StrategyLike) -> jax.sharding.Sharding:
    return strategy.per_replica_sharding
