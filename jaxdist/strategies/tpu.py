"""`TPUStrategy`: replicas made of several logical devices, on any backend.

TensorFlow's ``tf.distribute.TPUStrategy``. Without a device assignment every
device is one replica (data parallelism, as `MirroredStrategy`). With a
``jaxdist.tpu.experimental.DeviceAssignment`` of ``k`` cores per replica, each
replica spans ``k`` *logical devices*: the mesh has two axes, the replica axis
(`Strategy.axis_name`) and a logical axis (`TPUStrategy.logical_axis_name`), and
`run` compiles to a `jax.shard_map` that is manual over the replica axis only.
Inside the replica function arrays are whole (global over the logical devices
of the replica); XLA's SPMD partitioner lays them out over the logical axis,
guided by the annotations `experimental_split_to_logical_devices`,
`experimental_replicate_to_logical_devices` and
`experimental_assign_to_logical_device` (sharding constraints, as TF's XLA
sharding annotations). Collectives of the `ReplicaContext` still run over the
replica axis.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jaxdist._scope import current_replica_context
from jaxdist.cluster_resolver import ClusterResolver, initialize
from jaxdist.devices import LOGICAL_AXIS_NAME
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.extended import StrategyExtended

__all__ = ["LOGICAL_AXIS_NAME", "TPUStrategy", "TPUStrategyExtended"]


class _DeviceAssignmentLike(Protocol):
    """What `TPUStrategy` reads of a ``jaxdist.tpu.experimental.DeviceAssignment``."""

    @property
    def devices(self) -> np.ndarray: ...

    @property
    def num_replicas(self) -> int: ...

    @property
    def num_cores_per_replica(self) -> int: ...


def _device_grid(device_assignment: Any, where: str) -> np.ndarray:
    """The assignment's ``[num_replicas, num_cores_per_replica]`` array of JAX devices."""
    devices = getattr(device_assignment, "devices", None)
    grid = np.asarray(devices, dtype=object) if devices is not None else None
    if (
        grid is None
        or grid.ndim != 2
        or grid.size == 0
        or not all(isinstance(d, jax.Device) for d in grid.flat)
    ):
        raise TypeError(
            f"{where}(device_assignment=...): expected a jaxdist.tpu.experimental."
            f"DeviceAssignment, got {type(device_assignment).__name__}. Build one with "
            "jd.tpu.experimental.DeviceAssignment.build(computation_shape=[1, 1, 1, k], "
            "num_replicas=r)."
        )
    return grid


def _check_resolver(cluster_resolver: Any, where: str) -> Any:
    if cluster_resolver is None:
        return None
    if not isinstance(cluster_resolver, ClusterResolver):
        raise TypeError(
            f"{where}(cluster_resolver=...): expected a jaxdist.cluster_resolver."
            f"ClusterResolver (e.g. TPUClusterResolver()), got {type(cluster_resolver).__name__}."
        )
    initialize(cluster_resolver)  # a no-op for a one-process cluster
    return cluster_resolver


class TPUStrategyExtended(StrategyExtended):
    """`StrategyExtended` of a `TPUStrategy`, with TF's ``num_hosts`` and
    ``num_replicas_per_host``."""

    __slots__ = ()

    @property
    def num_hosts(self) -> int:
        """The number of processes (hosts) holding a replica's first logical device."""
        return len({d.process_index for d in self._strategy.replica_devices})

    @property
    def num_replicas_per_host(self) -> int:
        """Replicas per host: every local device without an assignment, else as many
        replicas as fit in a host's devices (TF's formula)."""
        strategy = cast("TPUStrategy", self._strategy)
        cores_per_host = jax.local_device_count()
        if strategy.logical_axis_name is None:
            return cores_per_host
        per_replica = strategy.num_logical_devices_per_replica
        return min(strategy.num_replicas_in_sync, cores_per_host // per_replica)


class TPUStrategy(Strategy):
    """Synchronous training over replicas of one or several logical devices each.

    Args:
        cluster_resolver: a `jaxdist.cluster_resolver.ClusterResolver` of a
            multi-process job (its `jax.distributed` is started, as
            `MultiWorkerMirroredStrategy` does); ``None``: the devices JAX
            already sees.
        device_assignment: a ``jaxdist.tpu.experimental.DeviceAssignment``:
            replica ``r`` runs on the devices ``device_assignment.devices[r]``,
            its logical devices ``0 .. num_cores_per_replica - 1``. ``None``:
            every device (``jax.devices()``) is a replica of one logical device.

    With an assignment the mesh is ``(num_replicas, num_cores_per_replica)``
    over the axes ``(axis_name, logical_axis_name)``; `run` is manual over the
    replica axis only, so a replica function sees whole arrays and XLA splits
    them over the logical devices where `experimental_split_to_logical_devices`
    says (or where its propagation decides). ``extended.worker_devices`` are
    the replicas' logical devices 0, and a variable has one local result per
    replica.

    Differences from TF: it runs on any backend (on CPU and GPU the devices
    are the cores of one chip, see ``DeviceAssignment.build``); `run` needs no
    ``tf.function`` (it always compiles); XLA's SPMD partitioner is always
    used (TF's ``experimental_spmd_xla_partitioning=True``), so
    `experimental_assign_to_logical_device` cannot pin a value to one logical
    device (JAX has no such sharding): it checks the id and replicates the
    value over the replica's logical devices. With one replica of several
    logical devices, XLA cannot compile a collective over the replica axis
    (of size 1) in a program that also shards over the logical axis, so the
    replica context's collectives and variable aggregations are identities
    there and emit none; a raw ``jax.lax`` collective over the replica axis
    still fails, and the error says why.

    Example:
        >>> import jax, jaxdist as jd
        >>> assignment = jd.tpu.experimental.DeviceAssignment.build(
        ...     computation_shape=[1, 1, 1, 2], num_replicas=4)
        >>> s = jd.TPUStrategy(device_assignment=assignment)
        >>> s.num_replicas_in_sync, dict(s.mesh.shape)
        (4, {'replica': 4, 'logical': 2})
    """

    __slots__ = ("_cluster_resolver", "_device_assignment", "_logical_grid")
    _cluster_resolver: Any
    _device_assignment: _DeviceAssignmentLike | None
    _logical_grid: np.ndarray  # [replicas, logical devices]

    def __init__(
        self, cluster_resolver: Any = None, device_assignment: _DeviceAssignmentLike | None = None
    ) -> None:
        where = "TPUStrategy"
        resolver = _check_resolver(cluster_resolver, where)
        if device_assignment is None:
            grid = np.array(jax.devices(), dtype=object).reshape(-1, 1)
        else:
            grid = _device_grid(device_assignment, where)
        grid.flags.writeable = False
        object.__setattr__(self, "_cluster_resolver", resolver)
        object.__setattr__(self, "_device_assignment", device_assignment)
        object.__setattr__(self, "_logical_grid", grid)
        super().__init__(tuple(grid[:, 0]))

    def make_mesh(self, grid: np.ndarray, axis_names: tuple[str, ...]) -> Mesh:
        if self._device_assignment is None:
            return super().make_mesh(grid, axis_names)
        names = (*axis_names, LOGICAL_AXIS_NAME)
        return Mesh(self._logical_grid, names, axis_types=(AxisType.Auto,) * len(names))

    def extra_key(self) -> tuple[Any, ...]:
        grid = self._logical_grid
        return (grid.shape, tuple(grid.flat), self._device_assignment is None)

    def __repr__(self) -> str:
        replicas, logical = self._logical_grid.shape
        return (
            f"TPUStrategy(num_replicas={replicas}, logical_devices_per_replica={logical}, "
            f"platform={self._devices[0].platform})"
        )

    def program_caller(
        self, call: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
        caller = super().program_caller(call)
        if self.num_replicas_in_sync > 1 or self.num_logical_devices_per_replica == 1:
            return caller
        note = (
            f"jaxdist: {self!r} has one replica, and XLA cannot compile a collective over a "
            "replica axis of size 1 beside a sharded logical axis (plain jax.shard_map fails "
            "the same way). With one replica every collective is an identity: the "
            "ReplicaContext's collectives (ctx.all_reduce, ...) leave them out for you; "
            "replace a jax.lax collective over the replica axis by its ctx method, or "
            "build the device assignment with num_replicas >= 2."
        )

        def explained(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            try:
                return caller(args, kwargs)
            except jax.errors.JaxRuntimeError as error:
                if "manual partitioning mode" in str(error):
                    error.add_note(note)
                raise

        return explained

    @property
    def extended(self) -> TPUStrategyExtended:
        return TPUStrategyExtended(self)

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver given to the constructor (``None``: none)."""
        return self._cluster_resolver

    @property
    def logical_axis_name(self) -> str | None:
        """The mesh axis of a replica's logical devices; ``None`` without a device
        assignment (one logical device per replica, no such axis)."""
        return None if self._device_assignment is None else LOGICAL_AXIS_NAME

    @property
    def num_logical_devices_per_replica(self) -> int:
        """How many logical devices (cores) each replica spans."""
        return int(self._logical_grid.shape[1])

    # Logical-device annotations (inside a replica function) -------------------------

    def _annotating(self, method: str, tensor: Any) -> Any:
        where = self._name(method)
        ctx = current_replica_context()
        if ctx is None or ctx.strategy != self:
            raise RuntimeError(
                f"{where} annotates a value inside a replica function: call it inside "
                f"the function given to this strategy's run (strategy.run(fn, args) or "
                "strategy.function(fn)), where XLA lays the value out over the replica's "
                "logical devices."
            )
        if not hasattr(tensor, "shape") or not hasattr(tensor, "dtype"):
            tensor = jax.numpy.asarray(tensor)
        return tensor

    def _constrain(self, tensor: Any, spec: P) -> Any:
        if self._device_assignment is None:
            return tensor  # no logical axis: one device per replica
        return lax.with_sharding_constraint(tensor, spec)

    def experimental_split_to_logical_devices(
        self, tensor: Any, partition_dimensions: Sequence[int]
    ) -> Any:
        """Annotates ``tensor`` as split over the replica's logical devices.

        Dimension ``i`` is cut into ``partition_dimensions[i]`` blocks; logical
        device ``k`` holds the block at position ``k`` of the blocks in row-major
        order (TF's tile assignment). One split dimension is a sharding
        constraint over the logical axis on that dimension; several are one
        constraint over the logical axis on the blocks of the tensor viewed as
        ``(number of blocks, *block shape)``.

        Args:
            tensor: an array of the replica function.
            partition_dimensions: one positive int per dimension of ``tensor``,
                dividing it, their product the number of logical devices per
                replica.

        Returns:
            ``tensor``, annotated (the same value).

        Raises:
            ValueError: as TF, checked in this order: the length differs from the
                rank of ``tensor``; a dimension is not divisible by its entry; the
                product differs from the number of logical devices.
            RuntimeError: outside a replica function of this strategy.
        """
        where = self._name("experimental_split_to_logical_devices")
        tensor = self._annotating("experimental_split_to_logical_devices", tensor)
        dims = _partition_dimensions(partition_dimensions, where)
        shape = tuple(tensor.shape)
        n = self.num_logical_devices_per_replica
        if len(dims) != len(shape):
            raise ValueError(
                f"{where}: the length of `partition_dimensions` must equal the rank of "
                f"`tensor.shape` ({len(shape)}, shape {shape}). Received "
                f"len(partition_dimensions)={len(dims)} ({dims}). Give one entry per "
                "dimension, 1 for a dimension that is not split."
            )
        for i, (size, split) in enumerate(zip(shape, dims, strict=True)):
            if split < 1:
                raise ValueError(
                    f"{where}: partition_dimensions[{i}] must be a positive int (1: not "
                    f"split), got {split} in {dims}."
                )
            if size % split:
                raise ValueError(
                    f"{where}: tensor shape at `partition_dimensions[{i}]` must be divisible "
                    f"by the corresponding value of `partition_dimensions` ({split}). "
                    f"Received: {size} (tensor shape {shape})."
                )
        splits = math.prod(dims)
        if splits != n:
            raise ValueError(
                f"{where}: the product of `partition_dimensions` should be the same as the "
                f"number of logical devices per replica (={n}). Received "
                f"`partition_dimensions`={dims}, and their product is {splits}. Mesh: "
                f"{dict(self.mesh.shape)}."
            )
        split_dims = [i for i, d in enumerate(dims) if d > 1]
        if len(split_dims) <= 1:
            spec: list[str | None] = [None] * len(shape)
            for i in split_dims:
                spec[i] = LOGICAL_AXIS_NAME
            return self._constrain(tensor, P(*spec))
        return self._split_blocks(tensor, dims)

    def _split_blocks(self, tensor: Any, dims: list[int]) -> Any:
        """Several split dimensions: the blocks, in row-major order, along one leading
        axis constrained over the logical axis, then viewed back as ``tensor``."""
        shape = tuple(tensor.shape)
        rank = len(shape)
        interleaved = [v for size, d in zip(shape, dims, strict=True) for v in (d, size // d)]
        to_blocks = [*range(0, 2 * rank, 2), *range(1, 2 * rank, 2)]
        block = [size // d for size, d in zip(shape, dims, strict=True)]
        tiles = tensor.reshape(interleaved).transpose(to_blocks)
        tiles = tiles.reshape(math.prod(dims), *block)
        tiles = self._constrain(tiles, P(LOGICAL_AXIS_NAME))
        back = np.argsort(to_blocks).tolist()
        return tiles.reshape(*dims, *block).transpose(back).reshape(shape)

    def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
        """Annotates ``tensor`` as replicated on every logical device of the replica
        (a sharding constraint with no split dimension); returns the same value."""
        tensor = self._annotating("experimental_replicate_to_logical_devices", tensor)
        return self._constrain(tensor, P())

    def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
        """Checks ``logical_device_id`` and annotates ``tensor`` for it; returns the same value.

        TF places the value on that one logical device. XLA's SPMD partitioner,
        which jaxdist always uses, has no JAX sharding for one device of a mesh,
        so the value is annotated as replicated over the replica's logical
        devices (every one holds it, logical device ``logical_device_id``
        included). Raises ``ValueError`` for an id out of range.
        """
        where = self._name("experimental_assign_to_logical_device")
        tensor = self._annotating("experimental_assign_to_logical_device", tensor)
        n = self.num_logical_devices_per_replica
        if (
            isinstance(logical_device_id, bool)
            or not isinstance(logical_device_id, numbers.Integral)
            or not 0 <= int(logical_device_id) < n
        ):
            raise ValueError(
                f"{where}: `logical_device_id` to assign must be lower than the number of "
                f"logical devices per replica. Received logical device id "
                f"{logical_device_id!r} but there are only {n} logical devices in a replica "
                f"(ids 0 to {n - 1})."
            )
        return self._constrain(tensor, P())


def _partition_dimensions(partition_dimensions: Any, where: str) -> list[int]:
    """``partition_dimensions`` as a list of ints (their values are checked by the caller,
    in TF's order)."""
    try:
        dims = list(partition_dimensions)
    except TypeError:
        raise TypeError(
            f"{where}: partition_dimensions must be a list of ints, one per dimension of "
            f"the tensor; got {partition_dimensions!r}."
        ) from None
    for i, d in enumerate(dims):
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(
                f"{where}: partition_dimensions[{i}] must be an int, got {d!r} in "
                f"{partition_dimensions!r}."
            )
    return [int(d) for d in dims]
