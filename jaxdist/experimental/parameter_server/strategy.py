"""`ParameterServerStrategy`: variables on parameter-server tasks, steps on worker tasks.

TF's ``tf.distribute.experimental.ParameterServerStrategy`` on Ray. The cluster is a
`jaxdist.cluster_resolver.ClusterResolver` with ``worker`` and ``ps`` jobs (addresses are
labels; ``rpc_layer="ray"``); the strategy starts one Ray actor per task in the caller's
Ray runtime (a local one, loopback only, if none is running) and never shuts Ray down.

Variables created in its ``scope()`` live on the ``ps`` tasks, placed round-robin per
variable, or per shard when ``variable_partitioner`` splits them; functions made with
``strategy.function`` run on the workers, asynchronously, through a
`jaxdist.experimental.coordinator.ClusterCoordinator`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist._scope import current_replica_context, strategy_scope
from jaxdist.experimental.parameter_server._cluster import task_counts, task_device
from jaxdist.experimental.parameter_server._ray import actor_env, ensure_ray, ray
from jaxdist.experimental.parameter_server.coordinator_context import (
    register_strategy,
    strategy_for,
)
from jaxdist.experimental.parameter_server.ps import ParameterServer
from jaxdist.experimental.parameter_server.updates import RecordingUpdates
from jaxdist.experimental.parameter_server.variables import (
    ParameterServerVariable,
    ShardedParameterServerVariable,
    unavailable,
)
from jaxdist.experimental.parameter_server.worker import Worker
from jaxdist.run_options import RunOptions
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.extended import StrategyExtended
from jaxdist.values.reduce_op import ReduceOp
from jaxdist.variables._dtype_rules import initial_array
from jaxdist.variables._sharded import div_rows, shard_count
from jaxdist.variables.meta import Meta, VariableAggregation, VariableSynchronization

__all__ = [
    "CoordinatorHolder",
    "ParameterServerStrategy",
    "ParameterServerStrategyExtended",
    "ScheduledFunction",
]

Sync = VariableSynchronization
Agg = VariableAggregation


def task_resource(job: str, index: int) -> str:
    """The Ray custom resource a `jaxdist.Server` node offers for the task ``job:index``."""
    return f"jaxdist_{job}_{index}"


class ScheduledFunction:
    """``strategy.function(fn)``: ``fn(ctx, *args)``, compiled on the worker that runs it.

    Pass it to `ClusterCoordinator.schedule`; only the function and its options travel.
    """

    __slots__ = ("fn", "options", "strategy")

    def __init__(self, fn: Callable[..., Any], options: RunOptions | None, strategy: Any) -> None:
        self.fn = fn
        self.options = options
        self.strategy = strategy

    def __reduce__(self) -> tuple[Any, ...]:
        return (ScheduledFunction, (self.fn, self.options, None))

    def compile_for(self, local_strategy: Any) -> Any:
        """The function compiled for ``local_strategy`` (called by the worker that runs it):
        it returns ``(fn's result, ClosureUpdates)``, the updates ``fn`` made with
        ``ctx.assign*`` (see `jaxdist.experimental.parameter_server.updates`)."""
        return local_strategy.function(RecordingUpdates(self.fn), options=self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"ParameterServerStrategy.function({getattr(self.fn, '__name__', 'fn')}): the "
            "function runs on the workers. Schedule it: "
            "ClusterCoordinator(strategy).schedule(fn, args=(...)), then .fetch() the result."
        )


@dataclasses.dataclass
class CoordinatorHolder:
    """A strategy's one `ClusterCoordinator`, set by the first ``ClusterCoordinator(strategy)``
    under ``lock``, with ``stop``, which stops its dispatcher threads."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    coordinator: Any = None
    stop: Callable[[], None] | None = None


_START_TIMEOUT = 180.0  # seconds for the actors to answer their first ping


class ParameterServerStrategyExtended(StrategyExtended):
    """``strategy.extended``: `jaxdist.StrategyExtended`, plus the actors of the tasks in
    task order. ``parameter_devices`` are TF's ps task names; ``worker_devices`` are the
    devices a replica runs on in this process (the coordinator's, or a worker's)."""

    __slots__ = ("_ps", "_workers")

    def __init__(self, strategy: Any, workers: tuple[Any, ...], ps: tuple[Any, ...]) -> None:
        super().__init__(strategy)
        self._workers = workers
        self._ps = ps

    @property
    def worker_actors(self) -> tuple[Any, ...]:
        """The Ray actor handle of each ``worker`` task (``ray.kill`` one to test
        preemption); empty in a worker's view of the strategy."""
        return self._workers

    @property
    def ps_actors(self) -> tuple[Any, ...]:
        """The Ray actor handle of each ``ps`` task."""
        return self._ps

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """TF's names of the ps tasks, e.g. ``/job:ps/replica:0/task:0``."""
        return tuple(task_device("ps", i) for i in range(len(self._ps)))

    @property
    def worker_tasks(self) -> tuple[str, ...]:
        """TF's names of the worker tasks, e.g. ``/job:worker/replica:0/task:0``."""
        return tuple(task_device("worker", i) for i in range(len(self._workers)))


_uids = itertools.count()

# Reductions along an axis of one replica's value, before the all-reduce across replicas.
_LOCAL_REDUCTIONS: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: jnp.sum,
    ReduceOp.MAX: jnp.max,
    ReduceOp.MIN: jnp.min,
}


class ParameterServerStrategy(Strategy):
    """Asynchronous training with variables on parameter servers (TF's
    ``ParameterServerStrategy``), on Ray; a `jaxdist.Strategy`.

    Args:
        cluster_resolver: a `jaxdist.cluster_resolver.ClusterResolver` whose cluster has
            ``worker`` and ``ps`` jobs and at most one ``chief`` (this process).
        variable_partitioner: an optional partitioner (such as
            `jaxdist.experimental.partitioners.FixedShardsPartitioner`) splitting
            variables created in the scope along their first axis; each shard is placed
            on a parameter server in turn.

    Raises:
        ValueError: the cluster is not a parameter-server cluster (TF's checks), before
            any actor starts.

    As in TF, one replica runs each closure (``num_replicas_in_sync`` is 1: a worker
    task computes on one device). In the coordinator, ``scope()`` places variables on the
    parameter servers, and ``reduce`` / ``gather`` / ``experimental_local_results`` take
    fetched results; `run` is for scheduled functions. Pickled into a closure, the
    strategy is, on the worker, that worker's view of it: ``strategy.run(fn, args)``
    inside a scheduled ``strategy.function`` calls ``fn(ctx, *args)`` in the same replica
    (its ``ctx.assign*`` count as the closure's), ``reduce`` there is the all-reduce of
    that replica's values, and outside a replica function (a ``dataset_fn``, a
    ``jax.jit`` closure) every method runs on the worker's device
    (``distribute_datasets_from_function`` inside ``create_per_worker_dataset``'s
    ``dataset_fn``, for example).

    The strategy is immutable and hashable (by identity: it owns its actors).
    """

    __slots__ = (
        "_coordinator",
        "_extended",
        "_ids",
        "_names",
        "_next_ps",
        "_on_worker",
        "_partitioner",
        "_resolver",
        "_uid",
    )
    _coordinator: CoordinatorHolder
    _extended: ParameterServerStrategyExtended
    _ids: Iterator[int]
    _names: dict[str, int]
    _next_ps: Iterator[int]
    _on_worker: bool
    _partitioner: Any
    _resolver: Any
    _uid: int

    def __init__(self, cluster_resolver: Any, variable_partitioner: Any = None) -> None:
        num_workers, num_ps = task_counts(cluster_resolver)
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "ParameterServerStrategy(variable_partitioner=...): expected a partitioner "
                "such as jd.experimental.partitioners.FixedShardsPartitioner(2), got "
                f"{type(variable_partitioner).__name__}."
            )
        ensure_ray()
        resources = ray.cluster_resources()
        ps = tuple(self._actor(ParameterServer, "ps", i, resources, 0) for i in range(num_ps))
        workers = tuple(
            self._actor(Worker, "worker", i, resources, -1, ParameterServerStrategy.worker_view)
            for i in range(num_workers)
        )
        actors = (*ps, *workers)
        try:  # started, or raise now
            ray.get([a.ping.remote() for a in actors], timeout=_START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise RuntimeError(
                f"ParameterServerStrategy: the {num_ps} ps and {num_workers} worker actors did "
                f"not all start within {_START_TIMEOUT:g} s (Ray could not place or start "
                "them: check ray.cluster_resources(), or that the jd.Server tasks have joined); "
                "stopped them."
            ) from None
        self._setup(next(_uids), cluster_resolver, variable_partitioner, workers, ps, False)
        register_strategy(self._uid, self)

    def _setup(
        self,
        uid: int,
        resolver: Any,
        partitioner: Any,
        workers: tuple[Any, ...],
        ps: tuple[Any, ...],
        on_worker: bool,
    ) -> None:
        s = object.__setattr__
        s(self, "_uid", uid)
        s(self, "_on_worker", on_worker)
        s(self, "_resolver", resolver)
        s(self, "_partitioner", partitioner)
        s(self, "_coordinator", CoordinatorHolder())
        s(self, "_ids", itertools.count())
        s(self, "_next_ps", itertools.count())
        s(self, "_names", {})
        super().__init__((jax.local_devices()[0],))  # the one replica of this process
        s(self, "_extended", ParameterServerStrategyExtended(self, workers, ps))

    @classmethod
    def worker_view(cls) -> ParameterServerStrategy:
        """The strategy as a worker task sees it (made once by each worker actor): no
        actors; `run`, `reduce` and the input methods run on the worker's device."""
        view = object.__new__(cls)
        cls._setup(view, -1, None, None, (), (), True)  # no actors: the worker's device
        return view

    def extra_key(self) -> tuple[Any, ...]:
        return (self._uid,)

    def __reduce__(self) -> tuple[Any, ...]:
        # A closure that uses the strategy carries its id: the coordinator's process finds
        # the strategy again, a worker its own view (see coordinator_context.strategy_for).
        return (strategy_for, (self._uid,))

    @staticmethod
    def _actor(
        cls: type, job: str, index: int, resources: dict[str, Any], restarts: int, *args: Any
    ) -> Any:
        resource = task_resource(job, index)
        options: dict[str, Any] = {
            "num_cpus": 0,
            "max_restarts": restarts,
            "max_task_retries": 0,
            "runtime_env": actor_env(),
        }
        if resource in resources:  # a jaxdist.Server joined the cluster as this task
            options["resources"] = {resource: 1}
        return ray.remote(cls).options(**options).remote(index, *args)

    def __repr__(self) -> str:
        if self._on_worker:
            return "ParameterServerStrategy(<a worker's view>)"
        ext = self._extended
        return f"ParameterServerStrategy(workers={len(ext.worker_actors)}, ps={len(ext.ps_actors)})"

    # The strategy API ------------------------------------------------------------------

    @property
    def cluster_resolver(self) -> Any:
        return self._resolver

    @property
    def extended(self) -> ParameterServerStrategyExtended:
        return self._extended

    @property
    def variable_partitioner(self) -> Any:
        return self._partitioner

    @property
    def coordinator_holder(self) -> CoordinatorHolder:
        """Where `ClusterCoordinator` keeps this strategy's one coordinator (jaxdist's own;
        make the coordinator with ``ClusterCoordinator(strategy)``)."""
        return self._coordinator

    @contextlib.contextmanager
    def scope(self) -> Iterator[ParameterServerStrategy]:
        """Variables created in the block live on the parameter servers."""
        with strategy_scope(self):
            yield self

    def function(  # type: ignore[override]
        self, fn: Callable[..., Any] | None = None, *, options: RunOptions | None = None
    ) -> Any:
        """Marks ``fn(ctx, *args)`` to run on workers through `ClusterCoordinator.schedule`."""
        if fn is None:
            return lambda f: self.function(f, options=options)
        if not callable(fn):
            raise TypeError(
                f"ParameterServerStrategy.function: fn must be callable, got {type(fn).__name__}."
            )
        return ScheduledFunction(fn, options, self)

    def run(
        self,
        fn: Callable[..., Any],
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """Inside a scheduled function: ``fn(ctx, *args, **kwargs)`` on the worker's replica
        (in a scheduled ``strategy.function``, the same replica: its updates are the
        closure's). In the coordinator it raises: replica functions run on workers."""
        if not self._on_worker:
            raise RuntimeError(
                "ParameterServerStrategy.run: the replica function runs on a worker. Call "
                "strategy.run inside a function given to ClusterCoordinator(strategy)."
                "schedule (write it as strategy.function(fn), fn receiving the replica "
                "context first), then .fetch() the result."
            )
        ctx = current_replica_context()
        if ctx is None:
            return super().run(fn, args, kwargs, options)
        if not callable(fn):
            raise TypeError(
                f"ParameterServerStrategy.run: fn must be callable, got {type(fn).__name__}."
            )
        return fn(ctx, *tuple(args), **(kwargs or {}))

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """`jaxdist.Strategy.reduce`; inside a scheduled ``strategy.function`` (a replica
        function on the worker), the all-reduce of the replica's ``value`` (reduced along
        ``axis`` first, element-weighted for ``MEAN``), as TF's reduce of ``run``'s result
        inside the scheduled function."""
        ctx = current_replica_context()
        if not self._on_worker or ctx is None:
            return super().reduce(reduce_op, value, axis)
        op = ReduceOp.from_any(reduce_op, where="ParameterServerStrategy.reduce")
        if axis is None:
            return ctx.all_reduce(op, value)
        if op is ReduceOp.MEAN:
            total = ctx.all_reduce(ReduceOp.SUM, jax.tree.map(lambda x: x.sum(axis), value))
            count = ctx.all_reduce(ReduceOp.SUM, jax.tree.map(lambda x: x.shape[axis], value))
            return jax.tree.map(lambda t, c: t / c, total, count)
        local = _LOCAL_REDUCTIONS[op]
        return ctx.all_reduce(op, jax.tree.map(lambda x: local(x, axis=axis), value))

    # Variables ---------------------------------------------------------------------------

    def create_variable(
        self,
        initial_value: Any,
        *,
        synchronization: Any = Sync.AUTO,
        aggregation: Any = Agg.NONE,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        partitioner: Any = None,
    ) -> Any:
        """``jd.Variable(...)`` in this strategy's scope (called by `jaxdist.Variable`)."""
        where = f"jaxdist.Variable(name={name!r}) under ParameterServerStrategy"
        if self._on_worker:
            raise RuntimeError(
                f"{where}: variables cannot be created on a worker (inside a scheduled "
                "function or a dataset_fn); create them in the coordinator, in "
                "strategy.scope(), and pass them to ClusterCoordinator.schedule."
            )
        sync = Sync.from_any(synchronization, where=where)
        agg = Agg.from_any(aggregation, where=where)
        if sync is Sync.AUTO:
            sync = Sync.ON_WRITE
        if sync is Sync.ON_READ and trainable:
            raise ValueError(
                f"{where}: synchronization ON_READ is only for non-trainable variables (such "
                "as metrics); pass trainable=False or use ON_WRITE."
            )
        trainable = (sync is not Sync.ON_READ) if trainable is None else bool(trainable)
        if callable(initial_value):
            initial_value = initial_value()
        value = np.asarray(initial_array(initial_value, dtype, where))
        name = self._unique_name(name or "Variable")
        partitioner = partitioner if partitioner is not None else self._partitioner
        shape = tuple(value.shape)
        n = (
            1
            if partitioner is None or not shape
            else shard_count(partitioner, shape, value.dtype, where)
        )
        if n <= 1:
            return self._place(value, sync, agg, trainable, name)
        offsets = np.cumsum([0, *div_rows(shape[0], n)])
        shards = tuple(
            self._place(
                value[int(offsets[i]) : int(offsets[i + 1])],
                sync,
                agg,
                trainable,
                f"{name}/part_{i}",
            )
            for i in range(n)
        )
        return ShardedParameterServerVariable(shards, name)

    def _unique_name(self, name: str) -> str:
        """``name``, or ``name_1``, ``name_2``... when taken (workers tell variables apart
        by name)."""
        names = self._names
        count = names.get(name, 0)
        names[name] = count + 1
        unique = name if count == 0 else f"{name}_{count}"
        while unique in names and unique != name:
            count += 1
            names[name] = count + 1
            unique = f"{name}_{count}"
        names.setdefault(unique, 1)
        return unique

    def _place(
        self, value: np.ndarray, sync: Sync, agg: Agg, trainable: bool, name: str
    ) -> ParameterServerVariable:
        ps = self._extended.ps_actors
        task = next(self._next_ps) % len(ps)
        var_id = next(self._ids)
        try:
            ray.get(ps[task].create.remote(var_id, value))
        except ray.exceptions.RayActorError as e:
            raise unavailable(task, e) from e
        meta = Meta(sync, agg, trainable, name, self, created_in_scope=True)
        return ParameterServerVariable.handle(
            var_id, ps[task], task, tuple(value.shape), value.dtype, meta, self._uid
        )

    def _shutdown(self) -> None:
        """Stops the coordinator's threads and kills this strategy's actors (private;
        tests and benchmarks that make many strategies in one Ray runtime)."""
        stop = self._coordinator.stop
        if stop is not None:
            stop()
        for actor in (*self._extended.worker_actors, *self._extended.ps_actors):
            ray.kill(actor)
