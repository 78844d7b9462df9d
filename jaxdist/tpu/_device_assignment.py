"""`DeviceAssignment`: which device runs each logical core of each replica (private;
public through ``jaxdist.tpu.experimental``).

TensorFlow's ``tf.tpu.experimental.DeviceAssignment``: a `Topology` plus a
``core_assignment`` array ``[num_replicas, num_cores_per_replica, 4]`` of mesh
coordinates. `DeviceAssignment.build` computes one with TF's algorithm:

1. One replica occupies a block of ``computation_shape`` cores, spaced by
   ``computation_stride``; its *footprint* is their product. As many blocks
   as fit along each axis, times the stride, is how many replicas fit.
2. The replicas form a grid chosen to be as close to a cube as possible,
   filling the most constrained axes first and, among equals, the core axis,
   then x, y, z (so the two cores of a chip go to one replica before two
   chips do).
3. When whole chips make one replica and every replica is used (a 4-D
   topology, ``computation_shape[-1] == cores per chip``, no stride),
   replicas and the chips inside a replica follow rings through the mesh
   (`ring_3d`). Otherwise replica ``r`` takes the block at its place in the
   grid (core axis fastest) and logical core ``k`` the ``k``-th core of the
   block (last axis fastest).
4. A topology with holes (missing devices) takes the devices in task order
   instead, without stride.

`DeviceAssignment.devices` is the result as JAX devices, an array
``[num_replicas, num_cores_per_replica]``: the device grid of a
``jax.sharding.Mesh`` with a replica axis and a logical-device axis.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, final

import numpy as np

from jaxdist.tpu._rings import ring_3d
from jaxdist.tpu._topology import Topology

__all__ = ["DeviceAssignment"]

_BUILD = "DeviceAssignment.build"


@final
class DeviceAssignment:
    """Maps each (replica, logical core) of a computation to a device of a `Topology`.

    Prefer `DeviceAssignment.build`; the constructor takes a ready
    ``core_assignment``.

    Args:
        topology: the `Topology` the coordinates refer to.
        core_assignment: an int array ``[num_replicas, num_cores_per_replica,
            topology.mesh_rank]``: the mesh coordinates of each logical core of
            each replica. Each must hold a device, and no device may be used
            twice.

    A `DeviceAssignment` is immutable and hashable, so a strategy can keep it
    as a static field.

    Example:
        >>> from jaxdist.tpu.experimental import DeviceAssignment
        >>> assignment = DeviceAssignment.build(computation_shape=[1, 1, 1, 2], num_replicas=4)
        >>> assignment.num_replicas, assignment.num_cores_per_replica
        (4, 2)
        >>> assignment.devices.shape  # the grid of a (replica, logical device) mesh
        (4, 2)
        >>> assignment.coordinates(1, 0)
        (0, 0, 0, 2)
    """

    __slots__ = ("_core_assignment", "_devices", "_topology")

    _topology: Topology
    _core_assignment: np.ndarray
    _devices: np.ndarray

    def __init__(self, topology: Topology, core_assignment: Any) -> None:
        where = "DeviceAssignment"
        if not isinstance(topology, Topology):
            raise ValueError(
                f"{where}: topology must be a Topology object, got {type(topology).__name__}. "
                "Build one with Topology.from_devices(devices)."
            )
        cores = np.array(core_assignment, dtype=np.int32)
        if cores.ndim != 3:
            raise ValueError(
                f"{where}: core_assignment must be a rank 3 numpy array [num_replicas, "
                f"num_cores_per_replica, {topology.mesh_rank}], got shape {cores.shape}."
            )
        if cores.shape[-1] != topology.mesh_rank:
            raise ValueError(
                f"{where}: core_assignment.shape[-1] must have size equal to topology rank "
                f"({topology.mesh_rank}), got core_assignment.shape={cores.shape}."
            )
        if cores.shape[0] == 0 or cores.shape[1] == 0:
            raise ValueError(
                f"{where}: core_assignment needs at least one replica and one core per "
                f"replica, got core_assignment.shape={cores.shape}."
            )
        devices = np.empty(cores.shape[:2], dtype=object)
        seen: dict[Any, tuple[int, int]] = {}
        for replica in range(cores.shape[0]):
            for core in range(cores.shape[1]):
                coordinates = cores[replica, core].tolist()
                try:
                    device = topology.device_at_coordinates(coordinates)
                except ValueError:
                    raise ValueError(
                        f"{where}: replica {replica}, logical core {core} is assigned to "
                        f"coordinates {coordinates}, where the topology (mesh shape "
                        f"{list(topology.mesh_shape)}) has no device."
                    ) from None
                if device in seen:
                    raise ValueError(
                        f"{where}: (replica, logical core) {seen[device]} and "
                        f"({replica}, {core}) are both assigned to {device} (coordinates "
                        f"{coordinates}); every logical core needs its own device."
                    )
                seen[device] = (replica, core)
                devices[replica, core] = device
        cores.flags.writeable = False
        devices.flags.writeable = False
        object.__setattr__(self, "_topology", topology)
        object.__setattr__(self, "_core_assignment", cores)
        object.__setattr__(self, "_devices", devices)

    @staticmethod
    def build(
        topology: Topology | None = None,
        computation_shape: Sequence[int] | np.ndarray | None = None,
        computation_stride: Sequence[int] | np.ndarray | None = None,
        num_replicas: int = 1,
    ) -> DeviceAssignment:
        """Places ``num_replicas`` replicas of a ``computation_shape`` block of cores.

        Args:
            topology: the `Topology` to place on (default: this process's
                devices, ``Topology.from_devices()``; on CPU and GPU that is
                ``mesh_shape == (1, 1, 1, n)``).
            computation_shape: 4 positive ints, the block of cores one replica
                uses (default ``[1, 1, 1, 1]``); ``[1, 1, 1, k]`` gives each
                replica ``k`` logical devices.
            computation_stride: 4 positive ints, the spacing of those cores
                in the mesh (default ``[1, 1, 1, 1]``, adjacent).
            num_replicas: the number of replicas, at most as many as fit.

        Raises:
            ValueError: for a shape or stride of the wrong length or not
                positive, a block that does not fit in the mesh, or more
                replicas than fit.
        """
        if topology is None:
            topology = Topology.from_devices()
        if not isinstance(topology, Topology):
            raise ValueError(
                f"{_BUILD}: `topology` is not a Topology object; got "
                f"{type(topology).__name__}. Pass Topology.from_devices(devices), or None for "
                "this process's devices."
            )
        mesh = np.asarray(topology.mesh_shape, dtype=np.int64)
        shape = _block_vector(topology, "computation_shape", computation_shape)
        stride = _block_vector(topology, "computation_stride", computation_stride)
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, numbers.Integral):
            raise TypeError(f"{_BUILD}: num_replicas must be a positive int; got {num_replicas!r}.")
        num_replicas = int(num_replicas)
        if num_replicas < 1:
            raise ValueError(f"{_BUILD}: num_replicas must be positive; got {num_replicas}.")

        footprint = shape * stride
        if (footprint > mesh).any():
            raise ValueError(
                f"{_BUILD}: computation footprint {footprint.tolist()} (computation_shape * "
                f"computation_stride) does not fit in TPU topology shape {mesh.tolist()}."
                + _layout_hint(topology)
            )
        replica_counts = (mesh // footprint) * stride
        max_replicas = int(np.prod(replica_counts))
        if num_replicas > max_replicas:
            raise ValueError(
                f"{_BUILD}: requested {num_replicas} replicas but only {max_replicas} replicas "
                f"with shape {shape.tolist()} and computation_stride {stride.tolist()} fit in a "
                f"TPU mesh of shape {mesh.tolist()}. Ask for at most {max_replicas} replicas, "
                "or fewer cores per replica."
            )
        if topology.missing_devices.size:
            cores = _in_task_order(topology, shape, stride, num_replicas)
        else:
            grid = _replica_grid(replica_counts, num_replicas)
            use_rings = (
                topology.mesh_rank == 4
                and shape[-1] == mesh[-1]
                and int(np.prod(stride)) == 1
                and num_replicas == max_replicas
            )
            if use_rings:
                cores = _along_rings(shape, grid, int(mesh[-1]), num_replicas)
            else:
                cores = _in_blocks(shape, stride, grid, num_replicas)
        return DeviceAssignment(topology, cores)

    @property
    def topology(self) -> Topology:
        """The `Topology` the coordinates refer to."""
        return self._topology

    @property
    def num_replicas(self) -> int:
        """The number of replicas of the computation."""
        return int(self._core_assignment.shape[0])

    @property
    def num_cores_per_replica(self) -> int:
        """The number of logical cores (devices) of each replica."""
        return int(self._core_assignment.shape[1])

    @property
    def core_assignment(self) -> np.ndarray:
        """The mesh coordinates of each logical core: int32 ``[replicas, cores, rank]``."""
        return self._core_assignment

    @property
    def devices(self) -> np.ndarray:
        """The device of each logical core: a read-only object array ``[replicas, cores]``.

        ``jax.sharding.Mesh(assignment.devices, ("replica", "logical"))`` is
        the mesh of a computation with this assignment.
        """
        return self._devices

    def _check(self, replica: int, logical_core: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise IndexError(
                f"DeviceAssignment: replica {replica} is out of range; there are "
                f"{self.num_replicas} replicas."
            )
        if not 0 <= logical_core < self.num_cores_per_replica:
            raise IndexError(
                f"DeviceAssignment: logical core {logical_core} is out of range; each replica "
                f"has {self.num_cores_per_replica} logical cores."
            )

    def coordinates(self, replica: int, logical_core: int) -> tuple[int, ...]:
        """The mesh coordinates of ``logical_core`` of ``replica``."""
        self._check(replica, logical_core)
        return tuple(int(c) for c in self._core_assignment[replica, logical_core])

    def tpu_device(self, replica: int = 0, logical_core: int = 0) -> Any:
        """The JAX device of ``logical_core`` of ``replica`` (TF returns its name)."""
        self._check(replica, logical_core)
        return self._devices[replica, logical_core]

    def tpu_ordinal(self, replica: int = 0, logical_core: int = 0) -> int:
        """The index, within its task, of the device of ``logical_core`` of ``replica``."""
        return self._topology.tpu_device_ordinal_at_coordinates(
            self.coordinates(replica, logical_core)
        )

    def lookup_replicas(self, task_id: int, logical_core: int) -> list[int]:
        """The replicas whose ``logical_core`` lives on task ``task_id``, sorted."""
        replicas = [
            r
            for r in range(self.num_replicas)
            if logical_core < self.num_cores_per_replica
            and self._topology.task_ordinal_at_coordinates(
                self._core_assignment[r, logical_core].tolist()
            )
            == task_id
        ]
        if not replicas:
            raise ValueError(
                f"Can not find any replica in task: {task_id} contains logical_core: "
                f"{logical_core}."
            )
        return replicas

    def _key(self) -> tuple[Any, ...]:
        cores = self._core_assignment
        return (self._topology, cores.shape, cores.tobytes())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceAssignment) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"DeviceAssignment is immutable; cannot set {name!r}.")

    def __repr__(self) -> str:
        return (
            f"DeviceAssignment(num_replicas={self.num_replicas}, "
            f"num_cores_per_replica={self.num_cores_per_replica}, topology={self._topology!r})"
        )


def _layout_hint(topology: Topology) -> str:
    if topology.mesh_shape[:3] == (1, 1, 1):
        n = topology.mesh_shape[3]
        return (
            f" These {n} devices form a mesh of shape [1, 1, 1, {n}] (the cores of one chip): "
            f"ask for computation_shape=[1, 1, 1, k] with k dividing {n}."
        )
    return ""


def _block_vector(topology: Topology, name: str, value: Any) -> np.ndarray:
    """``computation_shape`` or ``computation_stride``: ``mesh_rank`` positive ints."""
    rank = topology.mesh_rank
    if value is None:
        return np.ones(rank, dtype=np.int64)
    vector = np.asarray(value)
    if vector.size and not np.issubdtype(vector.dtype, np.integer):
        raise TypeError(f"{_BUILD}: {name} must be {rank} ints; got {value!r}.")
    vector = vector.astype(np.int64)
    if vector.shape != (rank,):
        raise ValueError(
            f"{_BUILD}: {name} must have shape [{rank}]; got {vector.shape}. TF's form is "
            f"[x, y, z, cores], e.g. [1, 1, 1, 2] for 2 logical devices per replica."
        )
    if (vector < 1).any():
        raise ValueError(f"{_BUILD}: {name} must be positive; got {name}={vector.tolist()}.")
    return vector


def _replica_grid(replica_counts: np.ndarray, num_replicas: int) -> list[int]:
    """How many replicas go along each axis: near a cube, constrained axes first.

    Axes are visited by increasing capacity, ties broken core axis first,
    then x, y, z; each takes the ceiling of the remaining replicas' root over
    the axes left, capped by its capacity (TF's rule, float root included).
    """
    rank = len(replica_counts)
    order = sorted(range(rank), key=lambda i: (int(replica_counts[i]), (i + 1) % rank))
    grid = [0] * rank
    remaining, axes_left = num_replicas, rank
    for axis in order:
        target = math.ceil(remaining ** (1.0 / axes_left))
        grid[axis] = min(target, int(replica_counts[axis]))
        remaining = -(-remaining // grid[axis])
        axes_left -= 1
    return grid


def _in_blocks(
    shape: np.ndarray, stride: np.ndarray, grid: list[int], num_replicas: int
) -> np.ndarray:
    """Replica ``r`` at its place in ``grid`` (core axis fastest, then x, y, z)."""
    rank = len(shape)
    visit = [rank - 1, *range(rank - 1)]
    offsets = np.zeros((num_replicas, rank), dtype=np.int64)
    for replica in range(num_replicas):
        place, rest = np.zeros(rank, dtype=np.int64), replica
        for axis in visit:
            place[axis], rest = rest % grid[axis], rest // grid[axis]
        offsets[replica] = (place // stride) * (shape * stride) + place % stride
    axes = [np.arange(0, shape[i] * stride[i], stride[i]) for i in range(rank)]
    block = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, rank)
    return block[None, :, :] + offsets[:, None, :]


def _along_rings(
    shape: np.ndarray, grid: list[int], cores_per_chip: int, num_replicas: int
) -> np.ndarray:
    """Whole-chip replicas: replicas along a ring of blocks, chips along a ring in each."""
    outer = ring_3d(*grid[:3])
    inner = ring_3d(int(shape[0]), int(shape[1]), int(shape[2]))
    cores = np.zeros((num_replicas, int(np.prod(shape)), 4), dtype=np.int64)
    for replica in range(num_replicas):
        block = np.asarray(outer[replica]) * shape[:3]
        for k in range(cores.shape[1]):
            chip = block + np.asarray(inner[k // cores_per_chip])
            cores[replica, k] = [*chip.tolist(), k % cores_per_chip]
    return cores


def _in_task_order(
    topology: Topology, shape: np.ndarray, stride: np.ndarray, num_replicas: int
) -> np.ndarray:
    """A topology with missing devices: logical cores take its devices in task order."""
    if int(np.prod(stride)) != 1:
        raise ValueError(
            f"{_BUILD}: the topology has {len(topology.missing_devices)} missing devices; "
            f"computation_stride must then be all ones, got {stride.tolist()}."
        )
    per_replica = int(np.prod(shape))
    available = topology.num_tasks * topology.num_tpus_per_task
    if num_replicas * per_replica > available:
        raise ValueError(
            f"{_BUILD}: requested {num_replicas} replicas of {per_replica} cores but the "
            f"topology has only {available} devices ({len(topology.missing_devices)} of its "
            f"mesh {list(topology.mesh_shape)} are missing)."
        )
    flat = topology.device_coordinates.reshape(-1, topology.mesh_rank)
    return flat[: num_replicas * per_replica].reshape(num_replicas, per_replica, -1)
