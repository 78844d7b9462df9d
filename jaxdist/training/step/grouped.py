"""Several train steps in one compiled call: ``steps_per_execution``.

A grouped call takes up to ``k`` batches from a distributed iterator, stacks
them along a new axis after the replica axis (one device copy for the group),
and runs the step function over them with a `jax.lax.scan` inside the
replicated program. The step's state (the NNX variables, the `TrainState`
arguments) is the scan's carry:

- it is carried typed as the same on every replica (it is: it left the
  previous iteration synchronised) and enters the step function cast to
  per-replica, as a single step's broadcast inputs do, so gradients taken
  inside are each replica's own;
- after each iteration, a value that differs between replicas is averaged
  when it is a float (per-replica statistics, as a single step averages them
  when it returns), else it is an error, as for a single step; the analysis
  that decides (`jaxdist._run.invariance.analyze`) runs once, on the one traced
  iteration, and the scan replays that trace.

Batches whose shapes differ from the group's first, or that carry their own
valid-row counts (a padded last batch), run as single steps: the results are
those of ``k`` single steps in every case.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist._jax_compat import eval_jaxpr, varies
from jaxdist._run.invariance import analyze, assume_invariant
from jaxdist.input.dataset import DistributedIterator
from jaxdist.input.group import PlacedGroup
from jaxdist.training.step.state import TrainState
from jaxdist.values.distributed import DistributedValues, PerReplica

__all__ = [
    "Stacked",
    "concat_outputs",
    "plan_runs",
    "runs",
    "scan_steps",
    "stack_batches",
    "TakenStates",
    "take_states",
    "unstack_outputs",
]


class Stacked:
    """``k`` batches stacked along axis 1 of each `PerReplica` leaf (a pytree, private):
    each replica sees its ``k`` batches along a new leading axis."""

    __slots__ = ("tree",)

    def __init__(self, tree: Any) -> None:
        self.tree = tree


jax.tree_util.register_pytree_node(
    Stacked, lambda s: ((s.tree,), None), lambda _, children: Stacked(children[0])
)


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def _signature(batch: Any) -> tuple[Any, ...] | None:
    """What batches must share to be stacked: structure, shapes, dtypes and the identity of
    their valid counts (full batches of a distributed dataset share one array); ``None``
    for a batch that is not all `PerReplica` leaves. A `PlacedGroup` has its batches'
    signature (its shapes without the step axis, a full batch's valid counts)."""
    if type(batch) is PlacedGroup:
        leaves, treedef = jax.tree.flatten(batch.tree, is_leaf=_is_per_replica)
        shapes = tuple(((x.array.shape[0], *x.array.shape[2:]), x.array.dtype) for x in leaves)
        return treedef, shapes, id(batch.valid)
    leaves, treedef = jax.tree.flatten(batch, is_leaf=_is_per_replica)
    if not leaves or not all(type(x) is PerReplica for x in leaves):
        return None
    valid = leaves[0].valid
    if any(x.valid is not valid for x in leaves):
        return None
    shapes = tuple((x.array.shape, x.array.dtype) for x in leaves)
    return treedef, shapes, id(valid)


def runs(batches: Sequence[Any]) -> list[list[Any]]:
    """``batches`` (or `PlacedGroup`s of them) cut into runs that can be stacked:
    consecutive items of the same signature. The cut depends only on the sequence of
    batches, not on how they were grouped when placed, so every process of a job cuts
    the same batches the same way."""
    out: list[list[Any]] = []
    last: Any = object()
    for b in batches:
        sig = _signature(b)
        if out and sig is not None and sig == last:
            out[-1].append(b)
        else:
            out.append([b])
        last = sig
    return out


@functools.cache
def _joiner(sharding: jax.sharding.Sharding, grouped: tuple[bool, ...]) -> Any:
    """One program joining a run's arrays along axis 1: a batch's gets a step axis of one,
    a group's (``grouped[i]``) has its own."""

    def join(columns: list[list[Any]]) -> list[Any]:
        return [
            jnp.concatenate([a if g else a[:, None] for a, g in zip(col, grouped, strict=True)], 1)
            for col in columns
        ]

    return jax.jit(join, out_shardings=sharding)


def stack_batches(run: Sequence[Any]) -> Stacked:
    """The batches (and `PlacedGroup`s) of one run as one `Stacked` batch: a `PerReplica`
    leaf of shape ``(N, steps, b, ...)`` per batch leaf; a run of one group as it is, else
    one program. The valid counts are dropped: a run of several batches holds full
    batches only (`runs`)."""
    if len(run) == 1 and type(run[0]) is PlacedGroup:
        return Stacked(run[0].tree)
    grouped = tuple(type(b) is PlacedGroup for b in run)
    trees = [
        jax.tree.flatten(b.tree if g else b, is_leaf=_is_per_replica)
        for b, g in zip(run, grouped, strict=True)
    ]
    treedef = trees[0][1]
    columns = [[leaves[i].array for leaves, _ in trees] for i in range(len(trees[0][0]))]
    sharding = columns[0][0].sharding
    stacked = _joiner(sharding, grouped)(columns)
    return Stacked(jax.tree.unflatten(treedef, [PerReplica(a) for a in stacked]))


def plan_runs(source: Iterator[Any], k: int) -> list[tuple[Any, int]]:
    """The next up to ``k`` batches of ``source`` as runs: ``(Stacked, steps)`` for a run
    of several steps, ``(batch, 1)`` for a single step; empty at the end of the data.

    A `jaxdist.DistributedIterator` hands over groups of full batches already
    placed as one array per leaf (`PlacedGroup`: one host copy and one transfer
    per group, no stacking on the devices). The runs are cut by `runs` from the
    batches alone, so a group and the batches placed alone beside it (read ahead
    before the first grouped call, whose number depends on timing) form one run,
    joined by one program on the devices, as batches of any other iterator are.
    """
    if isinstance(source, DistributedIterator):
        pieces = source.next_group(k)
    else:
        pieces = [(b, 1) for b in itertools.islice(source, k)]
    out: list[tuple[Any, int]] = []
    for run in runs([piece for piece, _ in pieces]):
        steps = sum(b.count if type(b) is PlacedGroup else 1 for b in run)
        if steps > 1:
            out.append((stack_batches(run), steps))
        else:
            (b,) = run
            out.append((b.batch() if type(b) is PlacedGroup else b, 1))
    return out


def _is_output_leaf(x: Any) -> bool:
    return isinstance(x, (TrainState, DistributedValues))


class TakenStates(NamedTuple):
    """A step's output taken apart by `take_states`."""

    states: list[Any]  # its `TrainState`s, one per `TrainState` argument, in order
    leaves: list[Any]  # its leaves, with those states as leaves
    tree: Any  # the output's tree structure
    positions: list[int]  # the states' positions among the leaves


def take_states(out: Any, count: int, where: str) -> TakenStates:
    """A step's output taken apart (`TakenStates`); ``count`` states are expected."""
    leaves, treedef = jax.tree.flatten(out, is_leaf=_is_output_leaf)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, TrainState)]
    if len(positions) != count:
        raise ValueError(
            f"{where}: with steps_per_execution > 1 the step must return the new value of "
            f"each of its {count} TrainState argument(s) (in the same order), so that the "
            f"next step of the group starts from it; it returned {len(positions)}. Return "
            "the state (`return state, loss`), or run with steps_per_execution=1."
        )
    return TakenStates([leaves[i] for i in positions], leaves, treedef, positions)


def scan_steps(
    one: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
    batches: Any,
    axis: Any,
    labels: Callable[[int], tuple[str, bool]],
) -> tuple[Any, list[Any]]:
    """Runs ``one(carry, batch) -> (carry, outputs)`` over the leading axis of ``batches``
    inside a replica function; returns the final carry and each output stacked.

    ``carry`` holds values that are the same on every replica (typed as such on entry);
    after each iteration a new carry value that differs between replicas is averaged
    or refused: ``labels(i)`` is (the name of carry leaf ``i``, whether it may be
    averaged when it is a float: NNX variables may, as in a single step; a
    `TrainState`'s arrays may not, a single step would return them per replica).
    ``outputs`` must be a flat list of arrays.
    """
    carry_leaves, carry_tree = jax.tree.flatten(carry)
    carry_leaves = [assume_invariant(x, axis) for x in carry_leaves]
    batch_leaves, batch_tree = jax.tree.flatten(batches)
    n_carry = len(carry_leaves)

    def flat_one(*xs: Any) -> list[Any]:
        # Per-replica inside the step, as a single step's broadcast inputs are: gradients
        # with respect to them are then this replica's own (JAX sums the gradient of an
        # input typed invariant over the replicas).
        c = jax.tree.unflatten(carry_tree, [lax.pcast(x, axis, to="varying") for x in xs[:n_carry]])
        b = jax.tree.unflatten(batch_tree, list(xs[n_carry:]))
        new, outs = one(c, b)
        new_leaves, new_tree = jax.tree.flatten(new)
        if new_tree != carry_tree:  # type: ignore[operator]
            raise ValueError(f"the state's structure changed in the step: {new_tree}")
        return [*new_leaves, *outs]

    first = [x[0] for x in batch_leaves]
    closed = jax.make_jaxpr(flat_one)(*carry_leaves, *first)
    infos = analyze(closed.jaxpr, axis)[:n_carry]

    def body(c: list[Any], b: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = eval_jaxpr(closed.jaxpr, closed.consts, *c, *b)
        synced = []
        for i, (x, old, info) in enumerate(zip(outs[:n_carry], c, infos, strict=True)):
            if info.varying:
                label, averaged = labels(i)
                if not averaged or not jnp.issubdtype(x.dtype, jnp.inexact):
                    raise ValueError(
                        f"{label} differs between replicas after a step, so it cannot be "
                        "carried to the next step of a group as one copy. Update it from "
                        "values that are the same on every replica (for example results "
                        "of ctx.all_reduce), or run with steps_per_execution=1."
                    )
                x = lax.pmean(x, axis)
            elif varies(x, axis):
                x = assume_invariant(x, axis)
            if x.dtype != old.dtype:
                x = x.astype(old.dtype)
            synced.append(x)
        return synced, list(outs[n_carry:])

    final, stacked = lax.scan(body, carry_leaves, batch_leaves)
    return jax.tree.unflatten(carry_tree, final), stacked


def concat_outputs(outs: list[tuple[Any, int]], n_states: int, where: str) -> Any:
    """The outputs of a group's runs as one: each array output stacked over the group's
    steps (axis 1 of a `PerReplica`), the `TrainState`s the last run's."""
    parts = []
    for out, steps in outs:
        _, leaves, tree, state_at = take_states(out, n_states, where)
        if steps == 1:  # a single step: a new leading axis of one
            leaves = [x if i in state_at else _with_step_axis(x) for i, x in enumerate(leaves)]
        parts.append(leaves)
    joined = [
        parts[-1][i] if i in state_at else _join(column)
        for i, column in enumerate(zip(*parts, strict=True))
    ]
    return jax.tree.unflatten(tree, joined)


def unstack_outputs(out: Any, steps: int, n_states: int, where: str) -> list[Any]:
    """A run's output as one output per step (``out`` itself for a single step)."""
    if steps == 1:
        return [out]
    _, leaves, tree, state_at = take_states(out, n_states, where)
    return [
        jax.tree.unflatten(
            tree, [x if i in state_at else _step_of(x, j) for i, x in enumerate(leaves)]
        )
        for j in range(steps)
    ]


def _with_step_axis(x: Any) -> Any:
    if isinstance(x, PerReplica):
        return PerReplica(x.array[:, None])
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.asarray(x)[None]
    return x


def _step_of(x: Any, j: int) -> Any:
    if isinstance(x, PerReplica):
        return PerReplica(x.array[:, j])
    if isinstance(x, (jax.Array, np.ndarray)):
        return x[j]
    return x


def _join(column: tuple[Any, ...]) -> Any:
    if len(column) == 1:
        return column[0]
    first = column[0]
    if isinstance(first, PerReplica):
        return PerReplica(jnp.concatenate([x.array for x in column], axis=1))
    if isinstance(first, (jax.Array, np.ndarray, np.generic)):
        return jnp.concatenate(column, axis=0)
    return column[-1]
