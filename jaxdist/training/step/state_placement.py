"""Placing training state on a strategy's devices in buffers of its own.

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

# One sharding for every leaf, or a tuple of them for a tuple of leaves.
_Shardings = jax.sharding.Sharding | tuple[jax.sharding.Sharding, ...]


@functools.cache
def _copier(sharding: _Shardings) -> Any:
    return jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=sharding)


def placed_copy(tree: Any, sharding: _Shardings) -> Any:
    """``tree`` with every array copied onto ``sharding`` (fresh buffers); a tuple of
    shardings places a tuple ``tree`` leaf by leaf."""
    return _copier(sharding)(tree)
