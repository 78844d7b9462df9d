"""Grouped execution: the callable a train step with ``steps_per_execution=k`` runs.

Each call takes up to ``k`` batches from the iterator among the arguments, cuts them
into runs (`jaxdist.training.step.grouped.plan_runs`) and runs each run of several
stackable batches as one scanned program and any other batch as a single step, the
`TrainState` arguments carried from run to run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import jax

from jaxdist.training.step.arguments import is_state_node
from jaxdist.training.step.grouped import (
    concat_outputs,
    plan_runs,
    take_states,
    unstack_outputs,
)
from jaxdist.training.step.state import TrainState

__all__ = ["GroupedStep", "SingleStep"]


class SingleStep(Protocol):
    """What `GroupedStep` needs of the `TrainStep` it groups."""

    last_call_steps: int
    where: str

    @property
    def steps_per_execution(self) -> int: ...

    def run_one(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def scan_variant(self, stack: bool) -> Any: ...


class GroupedStep:
    """A train step's grouped execution (``steps_per_execution=k``): each call takes up to
    ``k`` batches from the iterator among the arguments and runs them, runs of stackable
    batches (`runs`) in one scanned program each and any other batch as a single step.

    Args:
        step: the `TrainStep` (its single-step program runs the batches that do not
            stack; `TrainStep.scan_variant` gives the scanned programs).
        stack: return every step's outputs stacked (``stack_outputs``) instead of the
            last step's.
    """

    def __init__(self, step: SingleStep, stack: bool) -> None:
        self.step = step
        self.stack = stack
        # The scanned programs, by whether they stack every step's outputs: made on use.
        self._scans: dict[bool, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outs, n_states = self._outputs(args, kwargs, self.stack)
        if not self.stack:
            return outs[-1][0]
        return concat_outputs(outs, n_states, self.step.where)

    def each_step(self, *args: Any, **kwargs: Any) -> list[Any]:
        """One grouped call's outputs, one per step (a `TrainState` output is the group's
        last state in each)."""
        outs, n_states = self._outputs(args, kwargs, True)
        per_step: list[Any] = []
        for out, steps in outs:
            per_step.extend(unstack_outputs(out, steps, n_states, self.step.where))
        return per_step

    def _outputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], stack: bool
    ) -> tuple[list[tuple[Any, int]], int]:
        """(each run's output and its number of steps (1: a single step's output), the
        number of `TrainState` arguments)."""
        step, where = self.step, self.step.where
        k = step.steps_per_execution
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_state_node)
        found = [i for i, x in enumerate(leaves) if isinstance(x, Iterator)]
        if len(found) != 1:
            raise TypeError(
                f"{where}: with steps_per_execution={k}, pass one iterator of batches where "
                "the step's batch goes (for example "
                "`iter(strategy.experimental_distribute_dataset(dataset))`); each call takes "
                f"the next {k} batches from it. Got {len(found)} iterators among the "
                "arguments."
            )
        (pos,) = found
        planned = plan_runs(leaves[pos], k)
        if not planned:
            step.last_call_steps = 0
            raise StopIteration
        state_at = [i for i, x in enumerate(leaves) if isinstance(x, TrainState)]
        outs: list[tuple[Any, int]] = []
        for batch, steps in planned:
            leaves[pos] = batch
            a, kw = jax.tree.unflatten(treedef, leaves)
            if steps > 1:
                scan = self._scans.get(stack)
                if scan is None:
                    scan = self._scans[stack] = step.scan_variant(stack)
                out = scan.run_one(a, kw)
            else:
                out = step.run_one(a, kw)
            outs.append((out, steps))
            if state_at:  # the next run starts from the states this one returned
                new = take_states(out, len(state_at), where).states
                for i, state in zip(state_at, new, strict=True):
                    leaves[i] = state
        step.last_call_steps = sum(steps for _, steps in planned)
        return outs, len(state_at)
