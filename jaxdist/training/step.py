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
  gradients were not all-reduced; see `jaxdist.training._guards`). Random streams are
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
`jaxdist.training._nnx`): later calls read and write the variables directly.

``steps_per_execution=k`` runs k steps per call over the next k batches of an
iterator, in one ``lax.scan`` (see `jaxdist.training._grouped`);
``donate_argnums`` donates exactly the named functional arguments (a plain
pytree of parameters and optimizer state, say) instead of every `TrainState`.
"""

from __future__ import annotations

import collections.abc
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxdist._jax_compat import concrete_array_type
from jaxdist._programs import LoweredStep
from jaxdist._scope import get_strategy
from jaxdist.strategy import Strategy
from jaxdist.training import _sharded_state as sharded
from jaxdist.training._grouped import (
    concat_outputs,
    plan_runs,
    take_states,
    unstack_outputs,
)
from jaxdist.training._guards import (
    StateGuard,
    check_call,
    check_devices,
    object_labels,
    warn_host_batch,
)
from jaxdist.training._nnx import StateCache
from jaxdist.training._place import placed_copy
from jaxdist.training._step_args import (
    Layout,
    argument_label,
    is_state_node,
    probe,
)
from jaxdist.training._step_program import ObjectRef, StepProgram
from jaxdist.training.state import TrainState

__all__ = ["TrainStep", "train_step"]

_ARRAY: Any = concrete_array_type()


class TrainStep:
    """A compiled data-parallel training step (made by `train_step`).

    Attributes:
        last_call_steps: how many steps the last call ran: 1, or with
            ``steps_per_execution`` the batches it took (fewer than k at the end
            of the data); 0 before the first call. A
            `jaxdist.experimental.PreemptionCheckpointHandler` counts steps by it.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        strategy: Strategy | None,
        donate: bool,
        steps_per_execution: int = 1,
        stack_outputs: bool = False,
        *,
        donate_argnums: tuple[int, ...] | None = None,
        _grouped: bool = False,
        update_state: bool | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"jaxdist.train_step: fn must be callable, got {type(fn).__name__}.")
        self._fn = fn
        self._strategy = strategy
        self._donate = donate
        self.steps_per_execution = steps_per_execution
        self._stack = stack_outputs
        self._grouped = _grouped
        self._donate_argnums = donate_argnums
        self._checks = donate or donate_argnums is not None  # donated buffers to refuse
        # The programs over a group of batches (`_call_group`), by whether they stack the
        # outputs: steps of their own, with their own caches, made on first use.
        self._group_steps: dict[bool, TrainStep] = {}
        self._update_state = update_state  # None: True, except as jd.fit's eval_step
        self._warned_host = False
        self._programs: dict[Any, StepProgram] = {}
        self._caches: dict[tuple[int, ...], StateCache] = {}
        self._last: tuple[Any, ...] | None = None
        self.last_call_steps = 0
        name = getattr(fn, "__name__", "step")
        self._where = f"jaxdist.train_step({name})"
        functools.update_wrapper(self, fn)

    # The per-call path ------------------------------------------------------------

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        strategy = self._strategy if self._strategy is not None else get_strategy()
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_state_node)
        last = self._last
        if last is not None and last[0] is strategy and last[1] == treedef:
            _, _, layout, cache, program = last
            objects = layout.objects(leaves)
            if cache is None or cache.unchanged(objects):
                states, others = layout.split(leaves)
                values = cache.read() if cache is not None else []
                if self._checks:
                    self._check_donated(states, cache, values, args, kwargs)
                return strategy, layout, cache, program, values, states, others
        return self._slow_prepare(strategy, leaves, treedef, args, kwargs)

    def _donated_leaves(self, args: tuple[Any, ...]) -> set[int] | None:
        """The leaf positions of the arguments named by ``donate_argnums`` (None without)."""
        nums = self._donate_argnums
        if nums is None:
            return None
        if nums and nums[-1] >= len(args):
            raise ValueError(
                f"{self._where}: donate_argnums={nums} names argument {nums[-1]}, but the "
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
        name, where = argument_label(self._fn, obj, args, kwargs)
        kind = type(obj).__name__
        label = f"`{name}` ({where}, {kind})" if name else f"{where} ({kind})"
        return RuntimeError(
            f"{self._where}: argument {label} was donated: use the state the step returned. "
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
    ) -> tuple[Any, ...]:
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"{self._where}: strategy must be a jaxdist.Strategy, got "
                f"{type(strategy).__name__}."
            )
        check_call(self._fn, self._where, args, kwargs)
        if not self._warned_host:
            n = strategy.num_replicas_in_sync
            self._warned_host = warn_host_batch(self._fn, self._where, n, args, kwargs)
        layout = Layout(leaves, treedef, self._donated_leaves(args))
        objects = tuple(layout.objects(leaves))
        if len({id(o) for o in objects}) != len(objects):
            raise ValueError(
                f"{self._where}: the same NNX object is passed twice; pass each model or "
                "optimizer once."
            )
        cache: StateCache | None = None
        if objects:
            ids = tuple(map(id, objects))
            cache = self._caches.get(ids)
            if cache is None or not cache.unchanged(objects):
                cache = StateCache(objects, self._where)
                self._caches = {ids: cache}  # one structure kept: the one in use
        states, others = layout.split(leaves)
        if self._checks:  # before placing: a donated buffer must not reach the program
            self._check_donated(states, cache, [] if cache is None else cache.read(), args, kwargs)
        dims = sharded.state_dims(strategy, cache, states, self._where)
        if cache is not None:
            names = functools.partial(object_labels, self._fn, objects, args, kwargs)
            check_devices(self._where, strategy, cache.read(), cache.paths, names)
        if cache is not None and dims is not None:
            sharded.place_nnx(strategy, cache, dims[0])
        elif cache is not None:
            _place(strategy, cache)
        key = (strategy, layout.key(), None if cache is None else cache.graphdef, dims)
        program = self._programs.get(key)
        if program is None:
            guard = None
            if cache is not None:
                labels = object_labels(self._fn, objects, args, kwargs)
                guard = StateGuard(cache.variables, cache.paths, labels, self._where)
            program = StepProgram(
                self._fn,
                strategy,
                layout,
                cache,
                self._donate,
                self._where,
                grouped=self._grouped,
                stack=self._stack,
                donate_states=self._donate_argnums is not None,
                dims=dims,
                guard=guard,
                update_state=self._update_state is not False,
            )
            self._programs[key] = program
        self._last = (strategy, treedef, layout, cache, program)
        if dims is None:
            states = [_placed_state(strategy, s) for s in states]
        else:
            states = sharded.place_states(strategy, states, dims[1])
        values = cache.read() if cache is not None else []
        return strategy, layout, cache, program, values, states, others

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.steps_per_execution == 1 or self._grouped:
            return self._call_one(args, kwargs)
        return self._call_group(args, kwargs)

    def _call_group(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Takes up to ``steps_per_execution`` batches from the iterator among the
        arguments and runs them: runs of stackable batches (`runs`) in one program each,
        any other batch as a single step."""
        outs, n_states = self._group_outputs(args, kwargs, self._stack)
        if not self._stack:
            return outs[-1][0]
        return concat_outputs(outs, n_states, self._where)

    def _each_step(self, *args: Any, **kwargs: Any) -> list[Any]:
        """One grouped call's outputs, one per step (a `TrainState` output is the group's
        last state in each); for `jaxdist.fit`, which logs every step."""
        outs, n_states = self._group_outputs(args, kwargs, True)
        per_step: list[Any] = []
        for out, steps in outs:
            per_step.extend(unstack_outputs(out, steps, n_states, self._where))
        return per_step

    def _group_outputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], stack: bool
    ) -> tuple[list[tuple[Any, int]], int]:
        """(each run's output and its number of steps (1: a single step's output), the
        number of `TrainState` arguments)."""
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_state_node)
        where = [i for i, x in enumerate(leaves) if isinstance(x, collections.abc.Iterator)]
        if len(where) != 1:
            raise TypeError(
                f"{self._where}: with steps_per_execution={self.steps_per_execution}, pass "
                "one iterator of batches where the step's batch goes (for example "
                "`iter(strategy.experimental_distribute_dataset(dataset))`); each call takes "
                f"the next {self.steps_per_execution} batches from it. Got "
                f"{len(where)} iterators among the arguments."
            )
        (pos,) = where
        planned = plan_runs(leaves[pos], self.steps_per_execution)
        if not planned:
            self.last_call_steps = 0
            raise StopIteration
        state_at = [i for i, x in enumerate(leaves) if isinstance(x, TrainState)]
        outs: list[tuple[Any, int]] = []
        for batch, steps in planned:
            grouped = steps > 1
            leaves[pos] = batch
            a, kw = jax.tree.unflatten(treedef, leaves)
            if grouped:
                twin = self._group_steps.get(stack)
                if twin is None:
                    twin = self._group_steps[stack] = TrainStep(
                        self._fn, self._strategy, self._donate, 1, stack, _grouped=True
                    )  # (donate_argnums is refused with steps_per_execution)
                out = twin._call_one(a, kw)
            else:
                out = self._call_one(a, kw)
            outs.append((out, steps))
            if state_at:  # the next run starts from the states this one returned
                new, _, _, _ = take_states(out, len(state_at), self._where)
                for i, state in zip(state_at, new, strict=True):
                    leaves[i] = state
        self.last_call_steps = sum(steps for _, steps in planned)
        return outs, len(state_at)

    def _call_one(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        strategy, _, cache, program, values, states, others = self._prepare(args, kwargs)
        central = strategy._parameter_placed
        if central and values:  # central storage: NNX state lives on the parameter device
            values = jax.device_put(values, strategy.replicated_sharding)
        out, new_values = strategy._dispatch(program, (values, states, others), {})
        if cache is not None:
            if central:
                param = jax.sharding.SingleDeviceSharding(strategy.parameter_device)
                new_values = jax.device_put(new_values, param)
            if self._update_state is not False:
                cache.write(new_values)
            if program.has_refs[0]:
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
        _, _, _, program, values, states, others = self._prepare(args, kwargs)
        return LoweredStep(program.jitted.lower(values, states, others))

    def __repr__(self) -> str:
        return f"<jaxdist.train_step of {self._fn!r}>"


def _place(strategy: Strategy, cache: StateCache) -> None:
    """Puts NNX state replicated on the strategy's devices (once, when the cache is made),
    so the first step can donate it and later steps see the layout they return."""
    if strategy._parameter_placed:
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
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(
            f"jaxdist.train_step: strategy must be a jaxdist.Strategy, got "
            f"{type(strategy).__name__}."
        )
    if not isinstance(donate, bool):
        raise TypeError(f"jaxdist.train_step: donate must be a bool, got {donate!r}.")
    if (
        not isinstance(steps_per_execution, int)
        or isinstance(steps_per_execution, bool)
        or steps_per_execution < 1
    ):
        raise ValueError(
            "jaxdist.train_step: steps_per_execution must be an int >= 1 (the number of "
            f"steps one call runs), got {steps_per_execution!r}."
        )
    if not isinstance(stack_outputs, bool):
        raise TypeError(f"jaxdist.train_step: stack_outputs must be a bool, got {stack_outputs!r}.")
    nums: tuple[int, ...] | None = None
    if donate_argnums is not None:
        given = donate_argnums
        given = (given,) if isinstance(given, int) and not isinstance(given, bool) else given
        if not isinstance(given, (tuple, list)) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in given
        ):
            raise TypeError(
                "jaxdist.train_step: donate_argnums must be an int >= 0 or a tuple of them "
                f"(positions of the arguments after ctx), got {donate_argnums!r}."
            )
        nums = tuple(sorted(set(given)))
        if steps_per_execution > 1:
            raise ValueError(
                "jaxdist.train_step: donate_argnums cannot be combined with "
                "steps_per_execution > 1 (a group carries TrainState arguments and donates "
                "them per `donate`)."
            )
    if update_state is not None and not isinstance(update_state, bool):
        raise TypeError(
            f"jaxdist.train_step: update_state must be True, False or None, got {update_state!r}."
        )
    if update_state is False and steps_per_execution > 1:
        raise ValueError(
            "jaxdist.train_step: update_state=False (an evaluation step) cannot be combined "
            "with steps_per_execution > 1; evaluate one batch per call."
        )
    make = functools.partial(
        TrainStep,
        strategy=strategy,
        donate=donate,
        steps_per_execution=steps_per_execution,
        stack_outputs=stack_outputs,
        donate_argnums=nums,
        update_state=update_state,
    )
    return make if fn is None else make(fn)
