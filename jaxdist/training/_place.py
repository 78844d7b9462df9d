"""Placing training state on a strategy's devices in buffers of its own (private).

Train steps donate their state, so the state must not share a buffer with
arrays the user still holds (the parameters a model or `TrainState` was built
from). `jax.device_put` may reuse a source buffer as one shard of a
replicated array even with ``may_alias=False``; a jitted copy never does.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


@functools.cache
def _copier(sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=sharding)


def placed_copy(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """``tree`` with every array copied onto ``sharding`` (fresh buffers)."""
    return _copier(sharding)(tree)
