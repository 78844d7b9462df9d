"""Training state stored sharded over the replicas, for `jaxdist.train_step`.

A strategy that stores state sharded (`jaxdist.experimental.FSDPStrategy`)
answers `Strategy.state_dims` with the dimension each state leaf is sharded
on; other strategies answer ``None`` and nothing here runs. The step then

- places the NNX variables and `TrainState` arguments with those shardings
  (once, when its argument structure is new),
- wraps them as `jaxdist._run.compile.Sharded` inputs inside its jitted program
  (all-gathered when they enter the replica function), and
- returns the updated NNX state and `TrainState` results as
  `jaxdist._run.compile.Synced` leaves with a ``dim``: one copy, of which each
  device keeps its slice.

Leaves are named by their ``/``-joined path: ``layers/0/kernel`` for an NNX
variable (its path inside its object), ``params/Dense_0/kernel`` or
``opt_state/0/mu/Dense_0/kernel`` for a `TrainState` leaf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxdist._run.compile import Sharded, Synced, dim_spec
from jaxdist.strategies._sharded_create import key_str
from jaxdist.strategies.base import Strategy
from jaxdist.training.step.nnx import StateCache
from jaxdist.training.step.state import TrainState
from jaxdist.training.step.state_placement import placed_copy

__all__ = ["StateDims", "place_nnx", "place_states", "shard_in", "shard_out", "state_dims"]

# (dims of the NNX variables in state order, dims of each TrainState's leaves)
StateDims = tuple[tuple[int | None, ...], tuple[tuple[int | None, ...], ...]]


def tree_paths(tree: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of every leaf of ``tree``, the path ``/``-joined."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [("/".join(key_str(k) for k in path), leaf) for path, leaf in flat]


def state_dims(
    strategy: Strategy, cache: StateCache | None, states: Sequence[TrainState], where: str
) -> StateDims | None:
    """The dimension each state leaf is sharded on, or ``None`` when ``strategy`` keeps
    state replicated. Every leaf is laid out in one call, so one error lists every
    problem."""
    nnx_named: list[tuple[str, Any]] = []
    if cache is not None:
        values = cache.read()
        # cache paths are "<object index>.<key>.<key>...": the path inside the object
        nnx_named = [
            ("/".join(p.split(".")[1:]), v) for p, v in zip(cache.paths, values, strict=True)
        ]
    state_named = [tree_paths(s) for s in states]
    flat = nnx_named + [leaf for named in state_named for leaf in named]
    dims = strategy.state_dims(flat, where)
    if dims is None:
        return None
    it = iter(dims)
    nnx_dims = tuple(next(it) for _ in nnx_named)
    return nnx_dims, tuple(tuple(next(it) for _ in named) for named in state_named)


def _shardings(
    strategy: Strategy, values: Sequence[Any], dims: Sequence[int | None]
) -> tuple[Any, ...]:
    mesh, axis = strategy.mesh, strategy.axis_name
    return tuple(
        NamedSharding(mesh, dim_spec(axis, d, jax.numpy.ndim(v)))
        for v, d in zip(values, dims, strict=True)
    )


def _placed(values: list[Any], shardings: tuple[Any, ...]) -> list[Any]:
    if all(getattr(v, "sharding", None) == s for v, s in zip(values, shardings, strict=True)):
        return values
    return list(placed_copy(tuple(values), shardings))  # own buffers: the step donates them


def place_nnx(strategy: Strategy, cache: StateCache, dims: Sequence[int | None]) -> None:
    """Stores the NNX variables sharded as ``dims`` says (in place, fresh buffers)."""
    values = cache.read()
    placed = _placed(values, _shardings(strategy, values, dims))
    if placed is not values:
        cache.write(placed)


def place_states(
    strategy: Strategy, states: Sequence[TrainState], dims: Sequence[Sequence[int | None]]
) -> list[TrainState]:
    """The `TrainState`s with their leaves sharded as ``dims`` says."""
    out = []
    for state, state_dims_ in zip(states, dims, strict=True):
        leaves, treedef = jax.tree.flatten(state)
        placed = _placed(leaves, _shardings(strategy, leaves, state_dims_))
        out.append(state if placed is leaves else jax.tree.unflatten(treedef, placed))
    return out


def shard_in(values: Sequence[Any], dims: Sequence[int | None]) -> list[Any]:
    """Inside the step's jit: the sharded leaves wrapped as `Sharded` inputs."""
    return [v if d is None else Sharded(v, d) for v, d in zip(values, dims, strict=True)]


def shard_states_in(states: Sequence[TrainState], dims: StateDims) -> list[Any]:
    """Inside the step's jit: each `TrainState` with its sharded leaves wrapped."""
    out = []
    for state, state_dims_ in zip(states, dims[1], strict=True):
        leaves, treedef = jax.tree.flatten(state)
        out.append(jax.tree.unflatten(treedef, shard_in(leaves, state_dims_)))
    return out


def shard_out(strategy: Strategy, out: Any, where: str) -> Any:
    """Inside the replica function: every `TrainState` in the step's output with its
    leaves as `Synced` values that each device keeps its slice of."""

    def wrap(x: Any) -> Any:
        if not isinstance(x, TrainState):
            return x
        named = tree_paths(x)
        dims = strategy.state_dims(named, where) or [None] * len(named)
        leaves, treedef = jax.tree.flatten(x)
        synced = [
            Synced(leaf, f"TrainState leaf {path}", dim)
            for leaf, (path, _), dim in zip(leaves, named, dims, strict=True)
        ]
        return jax.tree.unflatten(treedef, synced)

    return jax.tree.map(wrap, out, is_leaf=lambda x: isinstance(x, TrainState))
