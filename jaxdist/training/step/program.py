"""The compiled program of a `jaxdist.train_step` for one strategy, argument layout and
NNX structure: the replica function around the user's step, its grouped
(``steps_per_execution``) form, the state guard and FSDP's sharded state."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdist._run.compile import Synced, replicated
from jaxdist.context import ReplicaContext
from jaxdist.strategies.base import Strategy
from jaxdist.training.step import sharded_state as sharded
from jaxdist.training.step.arguments import (
    Layout,
)
from jaxdist.training.step.grouped import (
    Stacked,
    scan_steps,
    take_states,
)
from jaxdist.training.step.guards import (
    StateGuard,
    check_outputs,
)
from jaxdist.training.step.nnx import StateCache
from jaxdist.training.step.sharded_state import StateDims
from jaxdist.values.distributed import DistributedValues
from jaxdist.variables import Variable

__all__ = ["ObjectRef", "StepProgram", "StepResult"]


class ObjectRef:
    """Stands for the ``i``-th NNX argument object in a step's output (private)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class StepResult(NamedTuple):
    """One step's output, and the NNX values after it."""

    out: Any
    new: list[Any]


@dataclasses.dataclass(eq=False)
class StepProgram:
    """The jitted step for one strategy, argument layout and NNX structure.

    A traced function with its configuration, as a dataclass: `jitted` is
    ``jax.jit`` of `program` (the global step), which runs `replica_fn` (one step)
    or, with ``grouped``, `grouped_fn` (a ``lax.scan`` of steps over a stacked
    group of batches) on every replica. Calling it runs the jitted program on
    ``(args, kwargs)`` (what `Strategy.dispatch_program` calls through `caller`).
    """

    fn: Callable[..., Any]
    strategy: Strategy
    layout: Layout
    cache: StateCache | None
    donate: bool
    where: str
    grouped: bool = False
    stack: bool = False
    donate_states: bool = False
    dims: StateDims | None = None  # state stored sharded (FSDPStrategy, MeshStrategy)
    guard: StateGuard | None = None
    update_state: bool = True
    # Set while tracing: an output holds an NNX argument object (an `ObjectRef`).
    has_refs: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        def program(nnx_values: list[Any], states: list[Any], others: list[Any]) -> Any:
            return self.program(nnx_values, states, others)

        program.__name__ = f"jaxdist_train_step_{getattr(self.fn, '__name__', 'fn')}"
        nnx_donated = (0,) if self.donate and self.update_state else ()
        donated = nnx_donated + ((1,) if self.donate or self.donate_states else ())
        self.jitted = jax.jit(program, donate_argnums=donated)
        self.caller = self.strategy.program_caller(self)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The jitted step on ``(values, states, others)``."""
        return self.jitted(*args)

    def program(self, nnx_values: list[Any], states: list[Any], others: list[Any]) -> Any:
        """The global step: the replicated step function, then the state guard."""
        dims = self.dims
        if dims is not None:
            nnx_values = sharded.shard_in(nnx_values, dims[0])
            states = sharded.shard_states_in(states, dims)
        step_fn = self.grouped_fn if self.grouped else self.replica_fn
        args = (nnx_values, states, others)
        out, new = replicated(step_fn, self.strategy, args, {}, plain=True)
        if self.guard is not None:
            self.guard.check(new)
        return out, new

    def replica_fn(
        self, ctx: ReplicaContext, nnx_values: list[Any], states: list[Any], others: list[Any]
    ) -> Any:
        """One step on one replica, its NNX values leaving synced."""
        out, new = self.one_step(ctx, nnx_values, states, others)
        return out, self.synced(new)

    def one_step(
        self, ctx: ReplicaContext, nnx_values: list[Any], states: list[Any], others: list[Any]
    ) -> StepResult:
        """The user's step function on one replica's arguments."""
        cache, where = self.cache, self.where
        objects: tuple[Any, ...] = ()
        entered = list(nnx_values)
        if cache is not None:
            if any(cache.is_key):
                rid = ctx.replica_id_in_sync_group
                entered = [
                    jax.random.fold_in(v, rid) if is_key else v
                    for v, is_key in zip(entered, cache.is_key, strict=True)
                ]
            objects = cache.rebuild(entered)
        layout = self.layout
        args, kwargs = jax.tree.unflatten(layout.treedef, layout.join(objects, states, others))
        out = self.fn(ctx, *args, **kwargs)
        if self.dims is not None:
            out = sharded.shard_out(self.strategy, out, where)
        if objects:
            out = self._refer_to_objects(out, objects)
        check_outputs(self.fn, where, out, (ObjectRef, DistributedValues, Variable, Synced))
        new: list[Any] = []
        if cache is not None:
            extracted = cache.extract(objects, where)
            if not self.update_state:  # nothing written back; parameters must not change
                assert self.guard is not None
                self.guard.check_unchanged(extracted, entered)
                return StepResult(out, new)
            for i, value in enumerate(extracted):
                if cache.is_key[i] and value is entered[i]:
                    value = nnx_values[i]  # the stream's key is unchanged: keep its base
                new.append(value)
        return StepResult(out, new)

    def _refer_to_objects(self, out: Any, objects: tuple[Any, ...]) -> Any:
        """``out`` with each NNX argument object in it replaced by an `ObjectRef`."""
        ids = {id(o): i for i, o in enumerate(objects)}

        def ref(x: Any) -> Any:
            if id(x) in ids and x is objects[ids[id(x)]]:
                self.has_refs = True
                return ObjectRef(ids[id(x)])
            return x

        return jax.tree.map(ref, out, is_leaf=lambda x: id(x) in ids)

    def synced(self, values: list[Any]) -> list[Any]:
        """The NNX values as the replicated program returns them: `Synced` (averaged when
        they differ), sliced when stored sharded, guarded parameters plain."""
        cache, dims, guard = self.cache, self.dims, self.guard
        assert cache is not None or not values
        n = self.strategy.num_replicas_in_sync
        result = []
        for i, value in enumerate(values):
            what = f"NNX variable {cache.paths[i]}"  # type: ignore[union-attr]
            layout = None if dims is None else dims[0][i]
            if layout is not None:  # stored sharded (FSDPStrategy, MeshStrategy): a block
                result.append(Synced(value, what, layout))
            elif guard is not None:
                # Parameters and optimizer state plain, so per-replica ones raise
                # (`StateGuard.check`); other state `Synced` (averaged when it differs).
                result.append(guard.output(i, value, Synced, n))
            else:
                result.append(Synced(value, what))
        return result

    def grouped_fn(
        self, ctx: ReplicaContext, nnx_values: list[Any], states: list[Any], others: list[Any]
    ) -> Any:
        """The steps of a group: `scan_steps` over the `Stacked` batch among ``others``."""
        where = self.where
        (pos,) = [i for i, x in enumerate(others) if isinstance(x, Stacked)]
        statics: list[Any] = []

        def one(carry: tuple[list[Any], list[Any]], batch: Any) -> Any:
            values, states_in = carry
            rest = list(others)
            rest[pos] = batch
            out, new = self.one_step(ctx, values, states_in, rest)
            new_states, leaves, tree, state_at = take_states(out, len(states_in), where)
            arrays = [i for i, x in enumerate(leaves) if i not in state_at and _is_array(x)]
            statics[:] = [tree, leaves, arrays, state_at]
            return (new, new_states), [jax.numpy.asarray(leaves[i]) for i in arrays]

        n_values = len(nnx_values)
        paths = [] if self.cache is None else self.cache.paths

        def label(i: int) -> tuple[str, bool]:
            if i < n_values:
                return f"{where}: NNX variable {paths[i]}", True
            return f"{where}: an array of a TrainState argument", False

        (values, new_states), stacked = scan_steps(
            one, (nnx_values, states), others[pos].tree, ctx.axis_name, label
        )
        tree, leaves, arrays, state_at = statics
        leaves = list(leaves)
        for i, y in zip(arrays, stacked, strict=True):
            leaves[i] = y if self.stack else y[-1]
        for i, state in zip(state_at, new_states, strict=True):
            leaves[i] = state
        return jax.tree.unflatten(tree, leaves), self.synced(values)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))
