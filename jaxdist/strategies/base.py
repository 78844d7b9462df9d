"""`Strategy` and `StrategyExtended`: a device mesh plus the rules for running on it.

A strategy is an immutable, hashable value registered as a pytree with no
leaves, so it can be compared, used as a dict key, and passed through
`jax.jit` as a static argument. `run` compiles a replica function to
`jax.shard_map` under `jax.jit` (see `jaxdist._run.compile`); the cross-replica
methods work on the global arrays that `PerReplica` and `Mirrored` hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import _cpu_gate
from jaxdist._jax_compat import is_incompatible_devices
from jaxdist._placement.arguments import onto_mesh, replica_values, variables_to
from jaxdist._run.compile import describe_bad_leaf, dim_spec
from jaxdist._run.programs import LoweredStep, Program, program_for
from jaxdist._scope import STATE, check_cross_replica, strategy_scope
from jaxdist.collectives.cross_device_ops import CrossDeviceOps, NcclAllReduce, ReduceOp
from jaxdist.run_options import RunOptions
from jaxdist.strategies._state_leaves import StateLeaf
from jaxdist.strategies.checks import (
    check_counts,
    check_mesh,
    check_not_empty,
    check_numeric,
    nested_run_error,
)
from jaxdist.strategies.extended import StrategyExtended
from jaxdist.strategies.input_methods import DatasetMethods
from jaxdist.values.cross_replica import gather_leaf, reduce_distributed, reduce_leaf
from jaxdist.values.distributed import DistributedValues, PerReplica, ValueContext
from jaxdist.variables import as_distributed, is_distributed, unshard

__all__ = ["Strategy"]

AXIS_NAME = "replica"


def _integer(axis: Any) -> Any:
    """``axis`` as a Python int where it is an integer of another kind (a NumPy integer, a
    0-d integer array), as TF takes them; anything else (a bool too) unchanged."""
    if isinstance(axis, (bool, np.bool_, int)):
        return axis
    try:
        return operator.index(axis)
    except TypeError:
        return axis


def _strong(fn: Callable[..., Any]) -> Callable[[], Callable[..., Any]]:
    return lambda: fn


class Strategy(DatasetMethods):
    """Base class of all strategies: a mesh with one replica axis, and how to use it.

    Subclasses fix the devices (`OneDeviceStrategy`, `MirroredStrategy`, ...);
    the methods here are shared and pure: they never change the strategy.

    Extension points: a subclass (`FSDPStrategy`, `TPUStrategy`,
    `MultiWorkerMirroredStrategy`, a mesh strategy) overrides these documented
    methods, and jaxdist's own higher layers (the train step, the extended API)
    call them; nothing outside this class reads its private members:

    - `make_mesh`: the mesh over the replicas' devices (extra axes inside a replica);
    - `extra_key`: fields beyond devices and cross-device ops that tell two
      strategies apart (equality, hashing, program caches);
    - `state_dims` / `state_specs`: how each training-state leaf is stored sharded;
    - `program_caller` / `dispatch_program`: the per-call path of a compiled
      program (a watchdog, a single-replica shortcut);
    - `gated`: eager multi-device work under the CPU gate;
    - `parameter_placed`, `replica_devices`: where variables live, and the
      devices in replica order.
    """

    __slots__ = (
        "_axis_name",
        "_cross_device_ops",
        "_devices",
        "_gate",
        "_hash",
        "_key",
        "_last_program",
        "_mesh",
        "_per_replica_sharding",
        "_replicated_sharding",
        "parameter_placed",
    )
    _devices: tuple[jax.Device, ...]  # in replica order
    _axis_name: str | tuple[str, ...]
    _gate: bool
    _hash: int  # jit hashes the (static) strategy on every run: computed once
    _key: tuple[Any, ...]
    _mesh: Mesh
    _cross_device_ops: CrossDeviceOps
    parameter_placed: bool  # variables live on one parameter device (central storage)
    _replicated_sharding: NamedSharding
    _per_replica_sharding: NamedSharding
    # [weakref to fn, program] of the last run() without options: a repeat call skips the
    # cache lookup.
    _last_program: list[Any]

    def __init__(
        self,
        devices: Sequence[jax.Device],
        cross_device_ops: CrossDeviceOps | None = None,
        *,
        mesh_shape: tuple[int, ...] | None = None,
        axis_names: tuple[str, ...] = (AXIS_NAME,),
    ) -> None:
        where = f"{type(self).__name__}(cross_device_ops=...)"
        if cross_device_ops is None:
            cross_device_ops = NcclAllReduce()
        elif not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                f"{where}: expected a jaxdist.CrossDeviceOps such as NcclAllReduce(), got "
                f"{type(cross_device_ops).__name__}."
            )
        devices = tuple(devices)
        # Replica r is device r of ``devices``; with several mesh axes (for example
        # ("host", "local")) the replica axis is all of them, in row-major order.
        shape, axis_names = check_mesh(type(self).__name__, len(devices), mesh_shape, axis_names)
        grid = np.array(devices, dtype=object).reshape(shape)
        mesh = self.make_mesh(grid, axis_names)
        object.__setattr__(
            self, "_axis_name", axis_names[0] if len(axis_names) == 1 else axis_names
        )
        object.__setattr__(self, "_devices", devices)
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_cross_device_ops", cross_device_ops)
        object.__setattr__(self, "_replicated_sharding", NamedSharding(mesh, P()))
        object.__setattr__(self, "_per_replica_sharding", NamedSharding(mesh, P(self._axis_name)))
        key = (type(self), devices, shape, axis_names, cross_device_ops, *self.extra_key())
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))
        object.__setattr__(self, "_gate", _cpu_gate.needs_gate(tuple(mesh.devices.flat)))
        object.__setattr__(self, "parameter_placed", self.parameter_device is not None)
        object.__setattr__(self, "_last_program", [None, None])  # [weakref to fn, caller]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_static(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"{type(self).__name__} is immutable")

    @property
    def replica_devices(self) -> tuple[jax.Device, ...]:
        """Every device of the strategy, in replica order (all processes)."""
        return self._devices

    def extra_key(self) -> tuple[Any, ...]:
        """Fields beyond devices and cross-device ops that tell two strategies apart."""
        return ()

    def state_dims(
        self, leaves: Sequence[tuple[str, Any]], where: str, *, whole: bool = True
    ) -> list[int | None] | None:
        """For training state stored sharded (`FSDPStrategy`): the dimension each
        ``(path, array)`` leaf is sharded on over the replica axis (``None``:
        replicated); ``where`` names the caller in errors; ``whole``: the leaves are a
        whole state (``False``: a part, such as one `TrainState` among the step's
        outputs, so whole-state checks are left out). ``None``: this strategy keeps
        training state replicated."""
        return None

    def state_specs(
        self, leaves: Sequence[StateLeaf], where: str, *, whole: bool = True
    ) -> list[P] | None:
        """For training state stored sharded: the `PartitionSpec` on `mesh` each
        `StateLeaf` (path, array, logical axis names) is stored with between steps
        (``P()``: replicated); ``None``: this strategy keeps training state
        replicated. The default reads `state_dims` (one dimension over the replica
        axis); `MeshStrategy` lays leaves out over several mesh axes."""
        dims = self.state_dims([(leaf.path, leaf.value) for leaf in leaves], where, whole=whole)
        if dims is None:
            return None
        return [
            dim_spec(self._axis_name, d, np.ndim(leaf.value))
            for leaf, d in zip(leaves, dims, strict=True)
        ]

    def make_mesh(self, grid: np.ndarray, axis_names: tuple[str, ...]) -> Mesh:
        """The mesh over ``grid`` (the replicas' devices, laid out along ``axis_names``).

        A subclass may add axes inside a replica (`TPUStrategy`'s logical devices);
        `run` is manual over ``axis_names`` only, so such axes stay automatic.
        """
        return Mesh(grid, axis_names, axis_types=(AxisType.Auto,) * len(axis_names))

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Strategy) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        devs = ", ".join(f"{d.platform}:{d.id}" for d in self._devices)
        return f"{type(self).__name__}(devices=[{devs}])"

    # Properties ---------------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The `jax.sharding.Mesh` whose axes ``axis_name`` enumerate the replicas."""
        return self._mesh

    @property
    def axis_name(self) -> str | tuple[str, ...]:
        """The mesh axis (or tuple of axes) replicas are laid out along; collectives in a
        replica function reduce over it."""
        return self._axis_name

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def replicated_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P())``: one copy on every replica's device (made once)."""
        return self._replicated_sharding

    @property
    def per_replica_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P(axis_name))``: row ``r`` of a leading replica axis on
        replica ``r``'s device, the layout of `PerReplica` values (made once)."""
        return self._per_replica_sharding

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        return self._cross_device_ops

    @property
    def extended(self) -> StrategyExtended:
        return StrategyExtended(self)

    @property
    def parameter_device(self) -> jax.Device | None:
        """The one device holding mirrored variables, or ``None`` when they are
        replicated on every replica's device."""
        return None

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver of a multi-worker strategy; ``None`` for local ones."""
        return None

    def _name(self, method: str) -> str:
        return f"{type(self).__name__}.{method}"

    # Scope --------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this the strategy of `get_strategy()` inside the ``with`` block.

        Re-entering the same strategy is fine; entering a different one raises
        ``RuntimeError``.
        """
        with strategy_scope(self):
            yield self

    # Running --------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """Calls ``fn(ctx, *args, **kwargs)`` once per replica and returns its outputs.

        `PerReplica` arguments are unwrapped (replica ``r`` sees row ``r``); all
        other arguments are broadcast to every replica, and gradients with respect
        to them are per replica, as in TF. Pass what ``fn`` differentiates as an
        argument: a value ``fn`` captures by closure is one value shared by the
        replicas, and ``jax.grad`` with respect to it already sums over them
        (all-reducing that again multiplies it by the number of replicas).

        Outputs that are the same on every replica come back `Mirrored` (one
        replicated copy), the others
        `PerReplica`, at the leaves of ``fn``'s output. "The same on every
        replica" is read from the computation, not only from JAX's types: results
        of ``ctx.all_reduce``, and anything computed from them and from broadcast
        arguments alone, such as parameters and optimizer state updated with
        all-reduced gradients (no extra communication: they are already identical
        on every device). With one replica, outputs are plain arrays (TF's
        regroup of a single value). Compiled once per function and argument
        signature.

        Example:
            >>> import jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> float(s.run(lambda ctx, x: ctx.all_reduce("sum", x * 2), args=(3.0,)))
            6.0
        """
        last = self._last_program
        ref = last[0]
        if (
            ref is not None
            and ref() is fn
            and options is None
            and type(args) is tuple
            and kwargs is None
        ):
            return last[1](args, {})  # the same function again: fast path
        if not callable(fn):
            raise TypeError(
                f"{self._name('run')}: fn must be callable, got {type(fn).__name__} "
                f"({fn!r:.60}). Pass the replica function itself: "
                "strategy.run(step, args=(...))."
            )
        if type(args) is not tuple:
            args = self._check_args(args)
        if kwargs is None:
            kwargs = {}
        elif type(kwargs) is not dict:
            raise TypeError(
                f"{self._name('run')}: kwargs must be a dict of keyword arguments, got "
                f"{type(kwargs).__name__}."
            )
        if options is not None and not isinstance(options, RunOptions):
            raise TypeError(
                f"{self._name('run')}: options must be a jaxdist.RunOptions, got "
                f"{type(options).__name__}."
            )
        program = program_for(fn, self, options)
        if options is None:
            try:  # held weakly, like the program cache: a dead function frees its program
                last[0], last[1] = weakref.ref(fn), program.caller
            except TypeError:
                last[0] = None
        return self.dispatch_program(program, args, kwargs)

    def _check_args(self, args: Any) -> tuple[Any, ...]:
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"{self._name('run')}: args must be a tuple or list of arguments, got "
                f"{type(args).__name__}. For one argument write args=(x,)."
            )
        return tuple(args)

    def dispatch_program(self, program: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs a compiled program: ``program.caller(args, kwargs)`` (see `program_caller`)."""
        return program.caller(args, kwargs)

    def program_caller(
        self, call: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
        """The per-call path of a compiled program, made once per program (`Program` and
        the train step's program keep it): ``call(args, kwargs)`` under the CPU gate when
        this strategy needs it, refusing to run inside a replica function, with a failed
        call recovered (`_recover`); for central storage, ON_WRITE variables visit the
        mesh for the call."""
        name = type(self).__name__
        caller = _cpu_gate.caller(
            call,
            functools.partial(self._recover, call),  # gated_call recovers under the gate
            STATE,
            lambda merging: nested_run_error(name, merging),
            gate=self._gate,
        )
        if self.parameter_placed:
            return functools.partial(self._dispatch_central, caller)
        return caller

    def _dispatch_central(
        self,
        caller: Callable[[tuple[Any, ...], dict[str, Any]], Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The caller for central storage: ON_WRITE variables visit the mesh for the call."""
        args, kwargs = variables_to(self._replicated_sharding, (args, kwargs))
        out = caller(args, kwargs)
        return variables_to(jax.sharding.SingleDeviceSharding(self.parameter_device), out)

    def _recover(
        self,
        call: Callable[[tuple[Any, ...], dict[str, Any]], Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        error: Exception,
    ) -> Any:
        """After a failed call: a better error, or the call again with arguments placed."""
        if isinstance(error, TypeError):
            better = describe_bad_leaf(self, args, kwargs)
            if better is not None:
                raise better from error
            raise error
        if not is_incompatible_devices(error):
            raise error
        # Some argument is committed to devices outside this strategy's mesh (for
        # example one replica's local result): place it on the mesh and retry.
        args, kwargs = onto_mesh(self, (args, kwargs))
        return call(args, kwargs)

    def function(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        options: RunOptions | None = None,
        donate_argnums: int | tuple[int, ...] | None = None,
    ) -> Any:
        """Decorator: the reusable compiled form of `run`.

        ``strategy.function(step)(*args, **kwargs)`` is
        ``strategy.run(step, args, kwargs)``, compiled once per argument signature
        and dispatched without `run`'s checks. ``.lower(*args, **kwargs)`` lowers it
        ahead of time (``.compile()``, ``.as_text()``).

        Example:
            >>> import jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> step = s.function(lambda ctx, x: ctx.all_reduce("sum", x))
            >>> float(step(2.0))
            2.0
        """
        if fn is None:
            return functools.partial(self.function, options=options, donate_argnums=donate_argnums)
        if not callable(fn):
            raise TypeError(
                f"{self._name('function')}: fn must be callable, got {type(fn).__name__}."
            )
        if options is not None and not isinstance(options, RunOptions):
            raise TypeError(
                f"{self._name('function')}: options must be a jaxdist.RunOptions, got "
                f"{type(options).__name__}."
            )
        if donate_argnums is not None:
            options = dataclasses.replace(options or RunOptions(), donate_argnums=donate_argnums)
        program = Program(_strong(fn), self, options, plain=False)
        caller = program.caller

        @functools.wraps(fn)
        def replicated(*args: Any, **kwargs: Any) -> Any:
            return caller(args, kwargs)

        def lower(*args: Any, **kwargs: Any) -> LoweredStep:
            """The program lowered for these arguments (arrays or `jax.ShapeDtypeStruct`s,
            e.g. a dataset's ``element_spec``); ``.compile()`` it ahead of time, or read
            its HLO with ``.as_text()``."""
            return program.lower(args, kwargs)

        replicated.lower = lower  # type: ignore[attr-defined]
        return replicated

    # Cross-replica API ------------------------------------------------------------------

    def gated(self, thunk: Callable[[], Any]) -> Any:
        """``thunk()``, under the CPU gate when this strategy's programs must not overlap."""
        return _cpu_gate.gated(thunk) if self._gate else thunk()

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces ``value`` across replicas (and along ``axis`` of each replica's value).

        With ``axis`` and ``MEAN`` the result is element-weighted: the sum of all
        elements over their total count. A non-distributed value is treated as
        the same on every replica.

        Example:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> float(s.reduce("mean", jd.PerReplica(jnp.array([[1.0, 2.0, 6.0]])), axis=0))
            3.0
        """
        where = self._name("reduce")
        check_cross_replica(self, "reduce")
        op = ReduceOp.from_any(reduce_op, where=where)
        axis = None if axis is None else _integer(axis)
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise TypeError(
                f"{where}: axis must be an int or None, got {axis!r}; None reduces across "
                "replicas only, an int also along that axis of each replica's value."
            )
        n = self.num_replicas_in_sync
        value = unshard(value)
        check_numeric(self, where, value)
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
        leaves = [as_distributed(x) for x in leaves]
        check_counts(self, where, leaves)
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            check_not_empty(where, op, leaves, axis)
        spread = [x for x in leaves if isinstance(x, DistributedValues)]

        def compute() -> Any:
            # Every distributed leaf in one program (one fused set of collectives);
            # plain values are checked and reduced on their own.
            done = iter(reduce_distributed(spread, where, op, axis, n) if spread else [])
            return jax.tree.unflatten(
                treedef,
                [
                    next(done)
                    if isinstance(x, DistributedValues)
                    else reduce_leaf(where, op, x, axis, n)
                    for x in leaves
                ],
            )

        return self.gated(compute)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's value along ``axis`` (cross-replica context)."""
        where = self._name("gather")
        check_cross_replica(self, "gather")
        axis = _integer(axis)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(
                f"{where}: axis must be an int naming the axis of each replica's value to "
                f"concatenate along (0 for a batch), got {axis!r}. To combine replicas "
                "without concatenating, use reduce."
            )
        n = self.num_replicas_in_sync
        value = unshard(value)
        check_numeric(self, where, value)
        check_counts(
            self, where, [as_distributed(x) for x in jax.tree.leaves(value, is_leaf=is_distributed)]
        )
        return self.gated(
            lambda: jax.tree.map(
                lambda leaf: gather_leaf(where, as_distributed(leaf), axis, n),
                value,
                is_leaf=is_distributed,
            )
        )

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This process's per-replica values of ``value``, one entry per local replica.

        A non-distributed value gives ``(value,)``. For a pytree with distributed
        leaves, each entry is a pytree of the same structure.
        """
        value = unshard(value)
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
        leaves = [as_distributed(x) for x in leaves]
        if not any(isinstance(x, DistributedValues) for x in leaves):
            return (value,)
        check_counts(self, self._name("experimental_local_results"), leaves)
        workers = self.extended.worker_devices
        columns = [
            replica_values(x, workers) if isinstance(x, DistributedValues) else (x,) * len(workers)
            for x in leaves
        ]
        return tuple(jax.tree.unflatten(treedef, list(row)) for row in zip(*columns, strict=True))

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """Builds `PerReplica` values from ``value_fn(ValueContext)``, called once per local
        replica; each leaf becomes one global array placed row by row on its replica's device."""
        where = self._name("experimental_distribute_values_from_function")
        if not callable(value_fn):
            raise TypeError(f"{where}: value_fn must be callable, got {type(value_fn)}.")
        n = self.num_replicas_in_sync
        me = jax.process_index()
        local = [(r, d) for r, d in enumerate(self._devices) if d.process_index == me]
        trees = [value_fn(ValueContext(r, n)) for r, _ in local]
        flat = [jax.tree_util.tree_flatten_with_path(t) for t in trees]
        treedef = flat[0][1]
        for (r, _), (_, td) in zip(local, flat, strict=True):
            if td != treedef:  # type: ignore[operator]
                raise ValueError(
                    f"{where}: value_fn returned different structures for replica {local[0][0]} "
                    f"({treedef}) and replica {r} ({td}); every replica must return the same "
                    "pytree structure."
                )
        sharding = self._per_replica_sharding
        out = []
        for i, (path, _) in enumerate(flat[0][0]):
            rows = [
                np.asarray(f[0][i][1]) if not isinstance(f[0][i][1], jax.Array) else f[0][i][1]
                for f in flat
            ]
            shapes = {(tuple(x.shape), x.dtype) for x in rows}
            check_numeric(self, where, rows[0], f"value_fn(ctx){jax.tree_util.keystr(path)}")
            if len(shapes) != 1:
                raise ValueError(
                    f"{where}: leaf {jax.tree_util.keystr(path) or '<root>'} differs in shape or "
                    f"dtype across replicas: {sorted(map(str, shapes))}. Per-replica values of "
                    "one leaf must agree so they can form one global array."
                )
            shape = (n, *rows[0].shape)
            # Row r goes to every device of replica r (several with logical devices).
            by_replica = {
                r: jax.numpy.asarray(x)[None] for x, (r, _) in zip(rows, local, strict=True)
            }
            pieces = [
                jax.device_put(by_replica[index[0].indices(n)[0]], d)  # type: ignore[index]
                for d, index in sharding.addressable_devices_indices_map(shape).items()
            ]
            out.append(
                PerReplica(jax.make_array_from_single_device_arrays(shape, sharding, pieces))
            )
        return jax.tree.unflatten(treedef, out)

    def experimental_run(self, fn: Callable[..., Any], input_iterator: Any = None) -> Any:
        """TF 1.x style: runs ``fn(ctx, inputs)`` on the next element of ``input_iterator``
        (a `DistributedIterator`), or ``fn(ctx)`` without one; see `run`."""
        if input_iterator is None:
            return self.run(fn)
        return self.run(fn, args=(next(input_iterator),))
