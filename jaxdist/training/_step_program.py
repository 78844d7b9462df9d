"""The compiled program of a `jaxdist.train_step` for one strategy, argument layout and
NNX structure (private): the replica function around the user's step, its grouped
(``steps_per_execution``) form, the state guard and FSDP's sharded state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxdist._compile import Synced, replicated
from jaxdist.context import ReplicaContext
from jaxdist.strategy import Strategy
from jaxdist.training import _sharded_state as sharded
from jaxdist.training._grouped import (
    Stacked,
    scan_steps,
    take_states,
)
from jaxdist.training._guards import (
    StateGuard,
    check_outputs,
)
from jaxdist.training._nnx import StateCache
from jaxdist.training._sharded_state import StateDims
from jaxdist.training._step_args import (
    Layout,
)
from jaxdist.values import DistributedValues
from jaxdist.variables import Variable

__all__ = ["ObjectRef", "StepProgram"]


class ObjectRef:
    """Stands for the ``i``-th NNX argument object in a step's output (private)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class StepProgram:
    """The jitted step for one strategy, argument layout and NNX structure."""

    __slots__ = ("call", "caller", "has_refs", "jitted", "strategy")

    def __init__(
        self,
        fn: Callable[..., Any],
        strategy: Strategy,
        layout: Layout,
        cache: StateCache | None,
        donate: bool,
        where: str,
        grouped: bool = False,
        stack: bool = False,
        donate_states: bool = False,
        dims: StateDims | None = None,  # state stored sharded (FSDPStrategy)
        guard: StateGuard | None = None,
        update_state: bool = True,
    ) -> None:
        self.strategy = strategy
        n = strategy.num_replicas_in_sync
        self.has_refs = [False]
        has_refs = self.has_refs

        def one_step(
            ctx: ReplicaContext, nnx_values: list[Any], states: list[Any], others: list[Any]
        ) -> tuple[Any, list[Any]]:
            """One step: (the step's output, the NNX values after it)."""
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
            args, kwargs = jax.tree.unflatten(layout.treedef, layout.join(objects, states, others))
            out = fn(ctx, *args, **kwargs)
            if dims is not None:
                out = sharded.shard_out(strategy, out, where)
            if objects:
                ids = {id(o): i for i, o in enumerate(objects)}

                def ref(x: Any) -> Any:
                    if id(x) in ids and x is objects[ids[id(x)]]:
                        has_refs[0] = True
                        return ObjectRef(ids[id(x)])
                    return x

                out = jax.tree.map(ref, out, is_leaf=lambda x: id(x) in ids)
            check_outputs(fn, where, out, (ObjectRef, DistributedValues, Variable, Synced))
            new: list[Any] = []
            if cache is not None:
                extracted = cache.extract(objects, where)
                if not update_state:  # nothing written back; parameters must not change
                    assert guard is not None
                    guard.check_unchanged(extracted, entered)
                    return out, new
                for i, value in enumerate(extracted):
                    if cache.is_key[i] and value is entered[i]:
                        value = nnx_values[i]  # the stream's key is unchanged: keep its base
                    new.append(value)
            return out, new

        def synced(values: list[Any]) -> list[Any]:
            assert cache is not None or not values
            result = []
            for i, value in enumerate(values):
                what = f"NNX variable {cache.paths[i]}"  # type: ignore[union-attr]
                dim = None if dims is None else dims[0][i]
                if dim is not None:  # stored sharded (FSDPStrategy): this device's slice
                    result.append(Synced(value, what, dim))
                elif guard is not None:
                    # Parameters and optimizer state plain, so per-replica ones raise
                    # (`StateGuard.check`); other state `Synced` (averaged when it differs).
                    result.append(guard.output(i, value, Synced, n))
                else:
                    result.append(Synced(value, what))
            return result

        def replica_fn(
            ctx: ReplicaContext, nnx_values: list[Any], states: list[Any], others: list[Any]
        ) -> Any:
            out, new = one_step(ctx, nnx_values, states, others)
            return out, synced(new)

        def grouped_fn(
            ctx: ReplicaContext, nnx_values: list[Any], states: list[Any], others: list[Any]
        ) -> Any:
            """The steps of a group: `scan_steps` over the `Stacked` batch among ``others``."""
            (pos,) = [i for i, x in enumerate(others) if isinstance(x, Stacked)]
            statics: list[Any] = []

            def one(carry: tuple[list[Any], list[Any]], batch: Any) -> Any:
                values, states_in = carry
                rest = list(others)
                rest[pos] = batch
                out, new = one_step(ctx, values, states_in, rest)
                new_states, leaves, tree, state_at = take_states(out, len(states_in), where)
                arrays = [i for i, x in enumerate(leaves) if i not in state_at and _is_array(x)]
                statics[:] = [tree, leaves, arrays, state_at]
                return (new, new_states), [jax.numpy.asarray(leaves[i]) for i in arrays]

            n_values = len(nnx_values)

            def label(i: int) -> tuple[str, bool]:
                if i < n_values:
                    return f"{where}: NNX variable {cache.paths[i]}", True  # type: ignore
                return f"{where}: an array of a TrainState argument", False

            (values, new_states), stacked = scan_steps(
                one, (nnx_values, states), others[pos].tree, ctx.axis_name, label
            )
            tree, leaves, arrays, state_at = statics
            leaves = list(leaves)
            for i, y in zip(arrays, stacked, strict=True):
                leaves[i] = y if stack else y[-1]
            for i, state in zip(state_at, new_states, strict=True):
                leaves[i] = state
            return jax.tree.unflatten(tree, leaves), synced(values)

        step_fn = grouped_fn if grouped else replica_fn

        def program(nnx_values: list[Any], states: list[Any], others: list[Any]) -> Any:
            if dims is not None:
                nnx_values = sharded.shard_in(nnx_values, dims[0])
                states = sharded.shard_states_in(states, dims)
            out, new = replicated(step_fn, strategy, (nnx_values, states, others), {}, plain=True)
            if guard is not None:
                guard.check(new)
            return out, new

        program.__name__ = f"jaxdist_train_step_{getattr(fn, '__name__', 'fn')}"
        nnx_donated = (0,) if donate and update_state else ()
        donated = nnx_donated + ((1,) if donate or donate_states else ())
        jitted = self.jitted = jax.jit(program, donate_argnums=donated)

        def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            """The jitted step on ``(values, states, others)``."""
            return jitted(*args)

        self.call = call
        self.caller = strategy._caller(call)  # what `Strategy._dispatch` runs


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))
