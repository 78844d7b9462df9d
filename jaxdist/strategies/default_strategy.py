"""The default strategy: what `get_strategy()` returns when none is set."""

from __future__ import annotations

import functools

import jax

from jaxdist._scope import register_default_strategy
from jaxdist.strategies.base import Strategy

__all__ = ["DefaultStrategy", "default_strategy"]


class DefaultStrategy(Strategy):
    """One replica on the default device, no collectives: plain JAX behind the strategy API."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__((jax.devices()[0],))


@functools.cache
def default_strategy() -> DefaultStrategy:
    return DefaultStrategy()


register_default_strategy(default_strategy, DefaultStrategy)
