"""Training state stored sharded on the mesh, for `jaxdist.train_step`.

A strategy that stores state sharded (`jaxdist.experimental.FSDPStrategy`,
`MeshStrategy`) answers `Strategy.state_specs` with the `PartitionSpec` each
state leaf is stored with; other strategies answer ``None`` and nothing here
runs. The step then

- places the NNX variables and `TrainState` arguments with those shardings
  (once, when its argument structure is new),
- wraps them as `jaxdist._run.compile.Sharded` inputs inside its jitted program
  (all-gathered over the replica axes when they enter the replica function),
  and
- returns the updated NNX state and `TrainState` results as
  `jaxdist._run.compile.Synced` leaves with their layout: one copy, of which each
  device keeps its block.

Leaves are named by their ``/``-joined path: ``layers/0/kernel`` for an NNX
variable (its path inside its object), ``params/Dense_0/kernel`` or
``opt_state/0/mu/Dense_0/kernel`` for a `TrainState` leaf, and carry the
logical axis names the model gave them (NNX ``out_sharding`` metadata, Linen
``LogicallyPartitioned`` boxes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._run.compile import Sharded, Synced
from jaxdist._run.stored import Stored, stored
from jaxdist.strategies._state_leaves import StateLeaf, state_leaves, variable_names
from jaxdist.strategies.base import Strategy
from jaxdist.training.step.nnx import StateCache
from jaxdist.training.step.state import TrainState
from jaxdist.training.step.state_placement import placed_copy

__all__ = [
    "StateDims",
    "place_nnx",
    "place_states",
    "shard_in",
    "shard_out",
    "shard_states_in",
    "state_dims",
]

Layouts = tuple[Stored | None, ...]
# (layouts of the NNX variables in state order, layouts of each TrainState's leaves)
StateDims = tuple[Layouts, tuple[Layouts, ...]]


def _layouts(strategy: Strategy, specs: Sequence[P]) -> Layouts:
    return tuple(stored(spec, strategy.mesh, strategy.axis_name) for spec in specs)


def state_dims(
    strategy: Strategy, cache: StateCache | None, states: Sequence[TrainState], where: str
) -> StateDims | None:
    """How each state leaf is stored, or ``None`` when ``strategy`` keeps state
    replicated. Every leaf is laid out in one call, so one error lists every
    problem."""
    nnx_named: list[StateLeaf] = []
    if cache is not None:
        values = cache.read()
        # cache paths are "<object index>.<key>.<key>...": the path inside the object
        nnx_named = [
            StateLeaf("/".join(p.split(".")[1:]), v, variable_names(var))
            for p, v, var in zip(cache.paths, values, cache.variables, strict=True)
        ]
    state_named = [state_leaves(s) for s in states]
    flat = nnx_named + [leaf for named in state_named for leaf in named]
    specs = strategy.state_specs(flat, where)
    if specs is None:
        return None
    layouts = _layouts(strategy, specs)
    it = iter(layouts)
    nnx_dims = tuple(next(it) for _ in nnx_named)
    return nnx_dims, tuple(tuple(next(it) for _ in named) for named in state_named)


def _shardings(
    strategy: Strategy, values: Sequence[Any], layouts: Sequence[Stored | None]
) -> tuple[Any, ...]:
    mesh = strategy.mesh
    return tuple(NamedSharding(mesh, P() if layout is None else layout.spec) for layout in layouts)


def _placed(values: list[Any], shardings: tuple[Any, ...]) -> list[Any]:
    if all(getattr(v, "sharding", None) == s for v, s in zip(values, shardings, strict=True)):
        return values
    return list(placed_copy(tuple(values), shardings))  # own buffers: the step donates them


def place_nnx(strategy: Strategy, cache: StateCache, layouts: Layouts) -> None:
    """Stores the NNX variables as ``layouts`` says (in place, fresh buffers)."""
    values = cache.read()
    placed = _placed(values, _shardings(strategy, values, layouts))
    if placed is not values:
        cache.write(placed)


def place_states(
    strategy: Strategy, states: Sequence[TrainState], layouts: Sequence[Layouts]
) -> list[TrainState]:
    """The `TrainState`s with their leaves stored as ``layouts`` says."""
    out = []
    for state, state_layouts in zip(states, layouts, strict=True):
        leaves, treedef = jax.tree.flatten(state)
        placed = _placed(leaves, _shardings(strategy, leaves, state_layouts))
        out.append(state if placed is leaves else jax.tree.unflatten(treedef, placed))
    return out


def shard_in(values: Sequence[Any], layouts: Layouts) -> list[Any]:
    """Inside the step's jit: the sharded leaves wrapped as `Sharded` inputs."""
    return [
        v if layout is None else Sharded(v, layout)
        for v, layout in zip(values, layouts, strict=True)
    ]


def shard_states_in(states: Sequence[TrainState], dims: StateDims) -> list[Any]:
    """Inside the step's jit: each `TrainState` with its sharded leaves wrapped."""
    out = []
    for state, state_layouts in zip(states, dims[1], strict=True):
        leaves, treedef = jax.tree.flatten(state)
        out.append(jax.tree.unflatten(treedef, shard_in(leaves, state_layouts)))
    return out


def shard_out(strategy: Strategy, out: Any, where: str) -> Any:
    """Inside the replica function: every `TrainState` in the step's output with its
    leaves as `Synced` values that each device keeps its block of."""

    def wrap(x: Any) -> Any:
        if not isinstance(x, TrainState):
            return x
        named = state_leaves(x)
        specs = strategy.state_specs(named, where, whole=False) or [P()] * len(named)
        leaves, treedef = jax.tree.flatten(x)
        synced = [
            Synced(leaf, f"TrainState leaf {item.path}", layout)
            for leaf, item, layout in zip(leaves, named, _layouts(strategy, specs), strict=True)
        ]
        return jax.tree.unflatten(treedef, synced)

    return jax.tree.map(wrap, out, is_leaf=lambda x: isinstance(x, TrainState))
