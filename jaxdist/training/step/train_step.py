"""`train_step`: a data-parallel training step over NNX objects or functional state.

``@jd.train_step(strategy)`` turns ``fn(ctx, *args, **kwargs)`` into a
compiled step. Each call runs ``fn`` once per replica (as `Strategy.run`
does), and:

- Flax NNX objects among the arguments (modules, optimizers, ``nnx.Rngs``, at
  any depth of the argument pytree) enter as their state arrays and are
  updated in place afterwards, as ``nnx.jit`` does. Their state comes back as
  one replicated copy: parameters and optimizer state updated from
  all-reduced gradients are already the same on every replica, so this costs
  no communication; other state that does differ (for example BatchNorm
  statistics of per-replica batches) is averaged across replicas, while
  parameters and optimizer state that differ raise ``ValueError`` (the
  gradients were not all-reduced; see `jaxdist.training.step.guards`). Random streams are
  folded with the replica id inside the step, so dropout masks differ between
  replicas, and advance identically, so the stored streams stay replicated.
- Every other argument and output is functional. An output that is the same
  on every replica (a `TrainState` after ``apply_gradients`` with all-reduced
  gradients, an all-reduced loss) comes back as a plain replicated
  `jax.Array`; one that differs comes back `PerReplica`.
- With ``donate=True`` the buffers of the NNX state and of `TrainState`
  arguments are donated to the step (updated in place on the device); a
  donated `TrainState` must not be used after the call: use the one returned.
  Passing one again raises a ``RuntimeError`` that names the argument (some
  JAX releases end the process when a program is given a donated buffer), at
  the cost of one ``is_deleted()`` per donated argument and call.

The NNX graph is walked once per structure, not per call (see
`jaxdist.training.step.nnx`): later calls read and write the variables directly.

``steps_per_execution=k`` runs k steps per call over the next k batches of an
iterator, in one ``lax.scan`` (see `jaxdist.training.step.grouped`);
``donate_argnums`` donates exactly the named functional arguments (a plain
pytree of parameters and optimizer state, say) instead of every `TrainState`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxdist._jax_compat import concrete_array_type
from jaxdist._run.programs import LoweredStep
from jaxdist._scope import get_strategy
from jaxdist.errors import DonatedArgumentError
from jaxdist.strategies.base import Strategy
from jaxdist.training.step import sharded_state as sharded
from jaxdist.training.step.arguments import (
    Layout,
    argument_label,
    is_state_node,
    probe,
)
from jaxdist.training.step.grouped_step import GroupedStep
from jaxdist.training.step.guards import (
    StateGuard,
    check_call,
    check_devices,
    object_labels,
    warn_host_batch,
)
from jaxdist.training.step.nnx import StateCache
from jaxdist.training.step.program import ObjectRef, StepProgram
from jaxdist.training.step.state import TrainState
from jaxdist.training.step.state_placement import placed_copy

__all__ = ["Prepared", "StepOptions", "TrainStep", "train_step"]

_ARRAY: Any = concrete_array_type()


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a `TrainStep` runs: `train_step`'s options as one frozen, checked record.

    `TrainStep.options` holds it and `TrainStep.replace` makes a step with some of
    the fields changed (``step.replace(update_state=False)``). The fields and their
    meaning are `train_step`'s; ``where`` is the name the step's errors give it
    (``None``: ``jaxdist.train_step(<function name>)``).
    """

    strategy: Strategy | None = None
    donate: bool = True
    steps_per_execution: int = 1
    stack_outputs: bool = False
    donate_argnums: tuple[int, ...] | None = None
    update_state: bool | None = None
    where: str | None = None

    def __post_init__(self) -> None:
        if self.strategy is not None and not isinstance(self.strategy, Strategy):
            raise TypeError(
                f"jaxdist.train_step: strategy must be a jaxdist.Strategy, got "
                f"{type(self.strategy).__name__}."
            )
        if not isinstance(self.donate, bool):
            raise TypeError(f"jaxdist.train_step: donate must be a bool, got {self.donate!r}.")
        k = self.steps_per_execution
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                "jaxdist.train_step: steps_per_execution must be an int >= 1 (the number of "
                f"steps one call runs), got {k!r}."
            )
        if not isinstance(self.stack_outputs, bool):
            raise TypeError(
                f"jaxdist.train_step: stack_outputs must be a bool, got {self.stack_outputs!r}."
            )
        if self.donate_argnums is not None:
            object.__setattr__(self, "donate_argnums", _argnums(self.donate_argnums))
            if k > 1:
                raise ValueError(
                    "jaxdist.train_step: donate_argnums cannot be combined with "
                    "steps_per_execution > 1 (a group carries TrainState arguments and "
                    "donates them per `donate`)."
                )
        if self.update_state is not None and not isinstance(self.update_state, bool):
            raise TypeError(
                "jaxdist.train_step: update_state must be True, False or None, got "
                f"{self.update_state!r}."
            )
        if self.update_state is False and k > 1:
            raise ValueError(
                "jaxdist.train_step: update_state=False (an evaluation step) cannot be "
                "combined with steps_per_execution > 1; evaluate one batch per call."
            )


def _argnums(given: Any) -> tuple[int, ...]:
    """``donate_argnums`` as a sorted tuple of distinct ints >= 0."""
    nums = (given,) if isinstance(given, int) and not isinstance(given, bool) else given
    if not isinstance(nums, (tuple, list)) or any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in nums
    ):
        raise TypeError(
            "jaxdist.train_step: donate_argnums must be an int >= 0 or a tuple of them "
            f"(positions of the arguments after ctx), got {given!r}."
        )
    return tuple(sorted(set(nums)))


class Prepared(NamedTuple):
    """What one call needs, found for its arguments: the strategy, the argument layout,
    the NNX state cache, the compiled program, and the NNX values, functional states and
    other arguments to call it with."""

    strategy: Strategy
    layout: Layout
    cache: StateCache | None
    program: StepProgram
    values: list[Any]
    states: list[Any]
    others: list[Any]


class _Last(NamedTuple):
    """The structure of the last call, for the fast path of the next."""

    strategy: Any
    treedef: Any
    layout: Layout
    cache: StateCache | None
    program: StepProgram


class TrainStep:
    """A compiled data-parallel training step (made by `train_step`).

    Args:
        fn: the step function, ``fn(ctx, *args, **kwargs)``.
        options: how it runs (`StepOptions`; `train_step`'s arguments).
        scan: compile ``fn`` as a ``lax.scan`` over a group of stacked batches (the
            form `GroupedStep` runs a run of several steps with).

    Attributes:
        fn: the step function.
        options: the `StepOptions`.
        last_call_steps: how many steps the last call ran: 1, or with
            ``steps_per_execution`` the batches it took (fewer than k at the end
            of the data); 0 before the first call. A
            `jaxdist.experimental.PreemptionCheckpointHandler` counts steps by it.
    """

    def __init__(
        self, fn: Callable[..., Any], options: StepOptions | None = None, *, scan: bool = False
    ) -> None:
        if not callable(fn):
            raise TypeError(f"jaxdist.train_step: fn must be callable, got {type(fn).__name__}.")
        options = StepOptions() if options is None else options
        self.fn = fn
        self.options = options
        self.scan = scan
        # Donated buffers to refuse before they reach a program.
        self._checks = options.donate or options.donate_argnums is not None
        self._warned_host = False
        self._programs: dict[Any, StepProgram] = {}
        self._caches: dict[tuple[int, ...], StateCache] = {}
        self._last: _Last | None = None
        self._grouped = (
            GroupedStep(self, options.stack_outputs)
            if options.steps_per_execution > 1 and not scan
            else None
        )
        self.last_call_steps = 0
        name = getattr(fn, "__name__", "step")
        self.where = options.where or f"jaxdist.train_step({name})"
        functools.update_wrapper(self, fn)

    @property
    def steps_per_execution(self) -> int:
        """``options.steps_per_execution``."""
        return self.options.steps_per_execution

    @property
    def strategy(self) -> Strategy | None:
        """The strategy given to `train_step` (``None``: the one in scope at call time)."""
        return self.options.strategy

    def replace(self, **changes: Any) -> TrainStep:
        """A new step over the same function with some `StepOptions` fields changed (its
        own compiled programs and caches)."""
        return TrainStep(self.fn, dataclasses.replace(self.options, **changes))

    def scan_variant(self, stack: bool) -> TrainStep:
        """The step compiled as a scan over a group of batches, stacking every step's
        outputs when ``stack`` (what `GroupedStep` runs a run of several steps with)."""
        options = dataclasses.replace(
            self.options, steps_per_execution=1, stack_outputs=stack, where=self.where
        )
        return TrainStep(self.fn, options, scan=True)

    # The per-call path ------------------------------------------------------------

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Prepared:
        strategy = self.strategy if self.strategy is not None else get_strategy()
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_state_node)
        last = self._last
        if last is not None and last.strategy is strategy and last.treedef == treedef:
            cache = last.cache
            objects = last.layout.objects(leaves)
            if cache is None or cache.unchanged(objects):
                states, others = last.layout.split(leaves)
                values = cache.read() if cache is not None else []
                if self._checks:
                    self._check_donated(states, cache, values, args, kwargs)
                return Prepared(strategy, last.layout, cache, last.program, values, states, others)
        return self._slow_prepare(strategy, leaves, treedef, args, kwargs)

    def _donated_leaves(self, args: tuple[Any, ...]) -> set[int] | None:
        """The leaf positions of the arguments named by ``donate_argnums`` (None without)."""
        nums = self.options.donate_argnums
        if nums is None:
            return None
        if nums and nums[-1] >= len(args):
            raise ValueError(
                f"{self.where}: donate_argnums={nums} names argument {nums[-1]}, but the "
                f"step was called with {len(args)} positional argument(s) (after ctx)."
            )
        out: set[int] = set()
        start = 0
        for i, arg in enumerate(args):
            n = len(jax.tree.leaves(arg, is_leaf=is_state_node))
            if i in nums:
                out.update(range(start, start + n))
            start += n
        return out

    def _check_donated(
        self,
        states: list[Any],
        cache: StateCache | None,
        values: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Raises if a donated argument holds buffers an earlier call donated: one
        ``is_deleted()`` per `TrainState` and per NNX object. (Given a deleted buffer,
        jax 0.10's multi-device CPU programs end the process instead of raising.)"""
        for state in states:
            array = probe(state)
            if array is not None and array.is_deleted():
                raise self._donated_error(
                    state,
                    "Its arrays were donated to an earlier call of this step, which reused "
                    "their buffers for the state it returned",
                    "Pass the state the previous call returned (`state, loss = step(state, "
                    "batch)`); to keep an old state, copy it before the step "
                    "(`jax.tree.map(jnp.copy, state)`)",
                    args,
                    kwargs,
                )
        if cache is not None:
            for obj_index, var_index in cache.probes:
                value = values[var_index]
                if type(value) is _ARRAY and value.is_deleted():
                    path = cache.paths[var_index].partition(".")[2]
                    raise self._donated_error(
                        cache.objects[obj_index],
                        f"Its NNX variable {path} holds an array that an earlier call of this "
                        "step donated (the step updates NNX objects in place; this array is "
                        "from before that call, e.g. restored with nnx.update from a state "
                        "saved before the step)",
                        "Keep using the objects the step updated; to restore saved state, "
                        "copy it when saving (`jax.tree.map(jnp.copy, nnx.state(model))`)",
                        args,
                        kwargs,
                    )

    def _donated_error(
        self, obj: Any, detail: str, fix: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> RuntimeError:
        name, where = argument_label(self.fn, obj, args, kwargs)
        kind = type(obj).__name__
        label = f"`{name}` ({where}, {kind})" if name else f"{where} ({kind})"
        return DonatedArgumentError(
            f"{self.where}: argument {label} was donated: use the state the step returned. "
            f"{detail}. {fix}, or make the step with jaxdist.train_step(..., donate=False) "
            "to keep its arguments."
        )

    def _slow_prepare(
        self,
        strategy: Any,
        leaves: list[Any],
        treedef: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Prepared:
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"{self.where}: strategy must be a jaxdist.Strategy, got {type(strategy).__name__}."
            )
        check_call(self.fn, self.where, args, kwargs)
        if not self._warned_host:
            n = strategy.num_replicas_in_sync
            self._warned_host = warn_host_batch(self.fn, self.where, n, args, kwargs)
        layout = Layout(leaves, treedef, self._donated_leaves(args))
        objects = tuple(layout.objects(leaves))
        if len({id(o) for o in objects}) != len(objects):
            raise ValueError(
                f"{self.where}: the same NNX object is passed twice; pass each model or "
                "optimizer once."
            )
        cache: StateCache | None = None
        if objects:
            ids = tuple(map(id, objects))
            cache = self._caches.get(ids)
            if cache is None or not cache.unchanged(objects):
                cache = StateCache(objects, self.where)
                self._caches = {ids: cache}  # one structure kept: the one in use
        states, others = layout.split(leaves)
        if self._checks:  # before placing: a donated buffer must not reach the program
            self._check_donated(states, cache, [] if cache is None else cache.read(), args, kwargs)
        dims = sharded.state_dims(strategy, cache, states, self.where)
        if cache is not None:
            names = functools.partial(object_labels, self.fn, objects, args, kwargs)
            check_devices(self.where, strategy, cache.read(), cache.paths, names)
        if cache is not None and dims is not None:
            sharded.place_nnx(strategy, cache, dims[0])
        elif cache is not None:
            _place(strategy, cache)
        key = (strategy, layout.key(), None if cache is None else cache.graphdef, dims)
        program = self._programs.get(key)
        if program is None:
            guard = None
            if cache is not None:
                labels = object_labels(self.fn, objects, args, kwargs)
                guard = StateGuard(cache.variables, cache.paths, labels, self.where)
            options = self.options
            program = StepProgram(
                self.fn,
                strategy,
                layout,
                cache,
                options.donate,
                self.where,
                grouped=self.scan,
                stack=options.stack_outputs,
                donate_states=options.donate_argnums is not None,
                dims=dims,
                guard=guard,
                update_state=options.update_state is not False,
            )
            self._programs[key] = program
        self._last = _Last(strategy, treedef, layout, cache, program)
        if dims is None:
            states = [_placed_state(strategy, s) for s in states]
        else:
            states = sharded.place_states(strategy, states, dims[1])
        values = cache.read() if cache is not None else []
        return Prepared(strategy, layout, cache, program, values, states, others)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._grouped is not None:
            return self._grouped(*args, **kwargs)
        return self.run_one(args, kwargs)

    def each_step(self, *args: Any, **kwargs: Any) -> list[Any]:
        """One grouped call's outputs, one per step (a `TrainState` output is the group's
        last state in each); for `jaxdist.fit`, which logs every step. Needs
        ``steps_per_execution > 1``."""
        if self._grouped is None:
            raise TypeError(
                f"{self.where}: each_step needs a step made with steps_per_execution > 1."
            )
        return self._grouped.each_step(*args, **kwargs)

    def run_one(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of the compiled program on ``args`` and ``kwargs`` (a single step, or
        with ``scan`` one run of stacked batches)."""
        strategy, _, cache, program, values, states, others = self._prepare(args, kwargs)
        central = strategy.parameter_placed
        if central and values:  # central storage: NNX state lives on the parameter device
            values = jax.device_put(values, strategy.replicated_sharding)
        out, new_values = strategy.dispatch_program(program, (values, states, others), {})
        if cache is not None:
            if central:
                param = jax.sharding.SingleDeviceSharding(strategy.parameter_device)
                new_values = jax.device_put(new_values, param)
            if self.options.update_state is not False:
                cache.write(new_values)
            if program.has_refs:
                objects = cache.objects
                out = jax.tree.map(
                    lambda x: objects[x.index] if isinstance(x, ObjectRef) else x,
                    out,
                    is_leaf=lambda x: isinstance(x, ObjectRef),
                )
        self.last_call_steps = 1
        return out

    def lower(self, *args: Any, **kwargs: Any) -> LoweredStep:
        """The step lowered for these arguments; ``.compile()`` it, read its HLO with
        ``.as_text()``, or its memory use with ``.compile().memory_analysis()``."""
        prepared = self._prepare(args, kwargs)
        jitted = prepared.program.jitted
        return LoweredStep(jitted.lower(prepared.values, prepared.states, prepared.others))

    def __repr__(self) -> str:
        return f"<jaxdist.train_step of {self.fn!r}>"


def _place(strategy: Strategy, cache: StateCache) -> None:
    """Puts NNX state replicated on the strategy's devices (once, when the cache is made),
    so the first step can donate it and later steps see the layout they return."""
    if strategy.parameter_placed:
        sharding: Any = jax.sharding.SingleDeviceSharding(strategy.parameter_device)
    else:
        sharding = strategy.replicated_sharding
    values = cache.read()
    if all(getattr(v, "sharding", None) == sharding for v in values):
        return
    # Own buffers: the step donates them, and the arrays the objects were built from may
    # still be used elsewhere.
    cache.write(placed_copy(values, sharding))


def _placed_state(strategy: Strategy, state: TrainState) -> TrainState:
    leaves = jax.tree.leaves(state)
    sharding = strategy.replicated_sharding
    if all(getattr(x, "sharding", None) == sharding for x in leaves[:1]):
        return state
    return placed_copy(state, sharding)


def train_step(
    fn: Callable[..., Any] | Strategy | None = None,
    strategy: Strategy | None = None,
    *,
    donate: bool = True,
    steps_per_execution: int = 1,
    stack_outputs: bool = False,
    donate_argnums: int | tuple[int, ...] | None = None,
    update_state: bool | None = None,
) -> Any:
    """Decorator: a compiled data-parallel train step over ``fn(ctx, *args, **kwargs)``.

    Args:
        strategy: the strategy to run on; ``None`` means the strategy of the
            enclosing ``strategy.scope()`` at call time (the default strategy
            outside any scope).
        donate: donate the buffers of NNX state and `TrainState` arguments.
        update_state: write the NNX objects' new state back after each call.
            ``False`` makes an evaluation step: nothing is written back (not
            even BatchNorm statistics or random-stream counters), the NNX
            state is not donated, and a step that updates parameters or
            optimizer state raises ``ValueError``. The default (``None``)
            writes back, except when `jaxdist.fit` runs the step as its
            ``eval_step`` (there it acts as ``False``); pass ``True`` to have
            fit's evaluation write state back.
        steps_per_execution: run this many steps in one compiled call (Keras's
            name and meaning). ``fn`` is still written for one batch; the caller
            passes an iterator of distributed batches where the batch goes
            (``iter(strategy.experimental_distribute_dataset(...))``), and each
            call takes the next ``steps_per_execution`` batches from it (fewer at
            the end of the data; a call with none left raises ``StopIteration``)
            and runs the steps in a ``lax.scan``, with the results of as many
            single steps. A step over `TrainState` arguments must return each
            one's new value (``return state, loss``). A padded last batch, or one
            shaped unlike the group's first, runs as a single step.
        donate_argnums: donate exactly these positional arguments (after ``ctx``;
            an int or a tuple) among the functional ones, as
            ``jax.jit(donate_argnums=...)``: a `TrainState`, or a plain pytree of
            parameters and optimizer state fed back each step; other `TrainState`
            arguments are then kept. NNX objects stay donated per ``donate``; a
            distributed batch is never donated. Not with ``steps_per_execution``.
        stack_outputs: with ``steps_per_execution``, return every step's outputs
            stacked on a new leading axis (axis 1 of a `PerReplica`, after the
            replica axis; `TrainState` outputs are the last step's) instead of the
            last step's.

    Use as ``@jd.train_step(strategy)``, ``@jd.train_step()`` or
    ``@jd.train_step``. The result is called with the step's arguments (without
    ``ctx``); it has ``.lower(*args)`` for ahead-of-time compilation.

    Example:
        >>> import jax.numpy as jnp, optax, jaxdist as jd
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> @jd.train_step
        ... def step(ctx, model, opt, x, y):
        ...     loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        ...     opt.update(model, ctx.all_reduce("sum", grads))
        ...     return ctx.all_reduce("sum", loss)
        >>> before = float(step(model, opt, jnp.ones((4, 2)), jnp.zeros((4, 1))))
        >>> after = float(step(model, opt, jnp.ones((4, 2)), jnp.zeros((4, 1))))
        >>> after < before
        True
    """
    if isinstance(fn, Strategy):  # @jd.train_step(strategy)
        fn, strategy = None, fn
    if fn is not None and not callable(fn):
        raise TypeError(
            f"jaxdist.train_step: expected a strategy or the step function, got "
            f"{type(fn).__name__}. Use @jd.train_step(strategy) or @jd.train_step."
        )
    options = StepOptions(
        strategy=strategy,
        donate=donate,
        steps_per_execution=steps_per_execution,
        stack_outputs=stack_outputs,
        donate_argnums=None if donate_argnums is None else _argnums(donate_argnums),
        update_state=update_state,
    )
    make = functools.partial(TrainStep, options=options)
    return make if fn is None else make(fn)
