"""`Topology`: where each device sits in a 4-D (x, y, z, core) mesh (public
through ``jaxdist.tpu.experimental``).

TensorFlow's ``tf.tpu.experimental.Topology`` describes a TPU slice by its
``mesh_shape`` (chips along x, y, z, and cores per chip) and the coordinates of
every (task, device) pair. jaxdist keeps that record and adds the JAX devices
themselves, so that a `DeviceAssignment` can hand out `jax.Device` objects.

`Topology.from_devices` builds one from JAX devices:

- TPU devices carry their physical place (``device.coords`` and
  ``device.core_on_chip``): the topology is the bounding box of the given
  devices, shifted to start at 0 (so one host of a larger slice is a small
  slice of its own).
- CPU and GPU devices have no physical coordinates. jaxdist lays them out as
  the cores of a single chip, ``mesh_shape == (1, 1, 1, n)``, in the order
  given (tasks by process index). That is the layout under which TF's usual
  way of asking for ``k`` logical devices per replica,
  ``computation_shape=[1, 1, 1, k]``, means what it says, and under which
  TF's placement (which fills the core dimension first) gives each replica
  ``k`` consecutive devices: neighbours by id, which on a GPU machine are
  usually the best-connected ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

import jax
import numpy as np

__all__ = ["Topology"]

_RANK = 4  # (x, y, z, core), as TF's TPU topologies


@final
class Topology:
    """The devices of a (TPU) slice and their (x, y, z, core) coordinates.

    Args:
        mesh_shape: 4 positive ints, the extent of the mesh along x, y, z and
            cores per chip.
        device_coordinates: an int array of shape ``[tasks, devices_per_task,
            4]``: the coordinates of each task's devices.
        devices: the devices, ``[tasks][devices_per_task]``, matching
            ``device_coordinates``.

    A `Topology` is immutable and hashable. Build one from JAX devices with
    `Topology.from_devices`.

    Example:
        >>> import jax
        >>> from jaxdist.tpu.experimental import Topology
        >>> topology = Topology.from_devices(jax.devices()[:4])  # 4 CPU devices
        >>> topology.mesh_shape
        (1, 1, 1, 4)
        >>> topology.device_coordinates[0, 3].tolist()
        [0, 0, 0, 3]
    """

    __slots__ = ("_by_coordinates", "_device_coordinates", "_devices", "_mesh_shape")

    _mesh_shape: tuple[int, ...]
    _device_coordinates: np.ndarray
    _devices: tuple[tuple[Any, ...], ...]
    _by_coordinates: dict[tuple[int, ...], tuple[int, int]]

    def __init__(
        self,
        mesh_shape: Sequence[int],
        device_coordinates: Any,
        devices: Sequence[Sequence[Any]],
    ) -> None:
        where = "Topology"
        shape = tuple(int(s) for s in np.asarray(mesh_shape, dtype=np.int64).reshape(-1))
        if len(shape) != _RANK or any(s < 1 for s in shape):
            raise ValueError(
                f"{where}: `mesh_shape` must be a sequence of {_RANK} positive entries "
                f"(x, y, z, cores per chip); got {list(shape)}."
            )
        coords = np.array(device_coordinates, dtype=np.int32)
        if coords.ndim != 3 or coords.shape[2] != _RANK:
            raise ValueError(
                f"{where}: `device_coordinates` must be a rank 3 int array [tasks, "
                f"devices_per_task, {_RANK}] (minor dimension equal to the mesh rank); got "
                f"shape {coords.shape}."
            )
        if coords.shape[0] * coords.shape[1] == 0:
            raise ValueError(f"{where}: a topology needs at least one device; got none.")
        outside = (coords < 0) | (coords >= np.asarray(shape))
        if outside.any():
            task, index = (int(i) for i in np.argwhere(outside.any(axis=-1))[0])
            raise ValueError(
                f"{where}: device ({task}, {index}) has coordinates "
                f"{coords[task, index].tolist()}, outside the mesh of shape {list(shape)}."
            )
        by_coordinates: dict[tuple[int, ...], tuple[int, int]] = {}
        for task in range(coords.shape[0]):
            for index in range(coords.shape[1]):
                key = tuple(int(c) for c in coords[task, index])
                if key in by_coordinates:
                    raise ValueError(
                        f"{where}: devices {by_coordinates[key]} and ({task}, {index}) share "
                        f"the coordinates {list(key)}; every device needs its own."
                    )
                by_coordinates[key] = (task, index)
        grid = tuple(tuple(row) for row in devices)
        if len(grid) != coords.shape[0] or any(len(row) != coords.shape[1] for row in grid):
            raise ValueError(
                f"{where}: `devices` must be laid out as `device_coordinates` "
                f"([{coords.shape[0]}][{coords.shape[1]}]); got rows of lengths "
                f"{[len(row) for row in grid]}."
            )
        flat = [d for row in grid for d in row]
        if len(set(flat)) != len(flat):
            raise ValueError(f"{where}: `devices` must be unique; got {flat}.")
        coords.flags.writeable = False
        object.__setattr__(self, "_mesh_shape", shape)
        object.__setattr__(self, "_device_coordinates", coords)
        object.__setattr__(self, "_devices", grid)
        object.__setattr__(self, "_by_coordinates", by_coordinates)

    @classmethod
    def from_devices(cls, devices: Sequence[Any] | None = None) -> Topology:
        """The topology of ``devices`` (default: this process's, `jax.local_devices()`).

        Devices are grouped into tasks by ``process_index`` (each task must
        have as many devices). TPU devices are placed by their physical
        ``coords`` and ``core_on_chip``; other devices become the cores of
        one chip, ``mesh_shape == (1, 1, 1, len(devices))``, in the order
        given.
        """
        if devices is None:
            devices = jax.local_devices()
        devices = list(devices)
        if not devices:
            raise ValueError("Topology.from_devices: the list of devices is empty.")
        tasks: dict[int, list[Any]] = {}
        for d in devices:
            tasks.setdefault(int(d.process_index), []).append(d)
        grid = [tasks[t] for t in sorted(tasks)]
        if len({len(row) for row in grid}) != 1:
            raise ValueError(
                "Topology.from_devices: every process (task) must contribute the same number "
                f"of devices; got {[(t, len(tasks[t])) for t in sorted(tasks)]} as "
                "(process_index, count)."
            )
        flat = [d for row in grid for d in row]
        if all(_physical_coordinates(d) is not None for d in flat):
            coords = np.array([_physical_coordinates(d) for d in flat], dtype=np.int64)
            coords -= coords.min(axis=0)  # one host of a larger slice starts at 0
            mesh_shape = tuple(int(c) + 1 for c in coords.max(axis=0))
        else:
            coords = np.zeros((len(flat), _RANK), dtype=np.int64)
            coords[:, -1] = np.arange(len(flat))
            mesh_shape = (1, 1, 1, len(flat))
        return cls(mesh_shape, coords.reshape(len(grid), len(grid[0]), _RANK), grid)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The extent of the mesh: ``(x, y, z, cores per chip)``."""
        return self._mesh_shape

    @property
    def mesh_rank(self) -> int:
        """The number of dimensions of the mesh (4)."""
        return len(self._mesh_shape)

    @property
    def device_coordinates(self) -> np.ndarray:
        """The coordinates of each device, a read-only int32 array ``[tasks, devices, 4]``."""
        return self._device_coordinates

    @property
    def devices(self) -> tuple[tuple[Any, ...], ...]:
        """The devices, ``[tasks][devices_per_task]``, as in `device_coordinates`."""
        return self._devices

    @property
    def num_tasks(self) -> int:
        """The number of tasks (processes) of the slice."""
        return int(self._device_coordinates.shape[0])

    @property
    def num_tpus_per_task(self) -> int:
        """The number of devices of each task (TF's name)."""
        return int(self._device_coordinates.shape[1])

    @property
    def missing_devices(self) -> np.ndarray:
        """The coordinates of the mesh cells with no device, ``[n, 4]`` (empty if none)."""
        present = np.zeros(self._mesh_shape, dtype=bool)
        present[tuple(self._device_coordinates.reshape(-1, _RANK).T)] = True
        return np.argwhere(~present)

    def _locate(self, coordinates: Sequence[int]) -> tuple[int, int]:
        key = tuple(int(c) for c in coordinates)
        try:
            return self._by_coordinates[key]
        except KeyError:
            raise ValueError(
                f"Topology: no device at coordinates {list(key)} in the mesh of shape "
                f"{list(self._mesh_shape)}."
            ) from None

    def task_ordinal_at_coordinates(self, device_coordinates: Sequence[int]) -> int:
        """The task (process) that holds the device at ``device_coordinates``."""
        return self._locate(device_coordinates)[0]

    def tpu_device_ordinal_at_coordinates(self, device_coordinates: Sequence[int]) -> int:
        """The index, within its task, of the device at ``device_coordinates``."""
        return self._locate(device_coordinates)[1]

    def device_at_coordinates(self, device_coordinates: Sequence[int]) -> Any:
        """The JAX device at ``device_coordinates``."""
        task, index = self._locate(device_coordinates)
        return self._devices[task][index]

    def _key(self) -> tuple[Any, ...]:
        coords = self._device_coordinates
        return (self._mesh_shape, coords.shape, coords.tobytes(), self._devices)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Topology is immutable; cannot set {name!r}.")

    def __repr__(self) -> str:
        n = self.num_tasks * self.num_tpus_per_task
        kinds = sorted({str(getattr(d, "platform", "?")) for row in self._devices for d in row})
        return (
            f"Topology(mesh_shape={self._mesh_shape}, num_tasks={self.num_tasks}, "
            f"devices={n} {'/'.join(kinds)})"
        )


def _physical_coordinates(device: Any) -> tuple[int, ...] | None:
    """``(x, y, z, core)`` of a TPU device; ``None`` for devices without a physical place."""
    coords = getattr(device, "coords", None)
    core = getattr(device, "core_on_chip", None)
    if coords is None or core is None or len(coords) != _RANK - 1:
        return None
    return (*(int(c) for c in coords), int(core))
