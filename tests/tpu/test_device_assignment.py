"""`jd.tpu.experimental.DeviceAssignment.build` places replicas of several logical devices
as TensorFlow's does, on the 8 simulated CPU devices (a (1, 1, 1, 8) topology) and on
stand-in TPU devices that carry physical coordinates."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist.tpu._rings import ring_3d
from jaxdist.tpu.experimental import DeviceAssignment, Topology


def _ids(assignment: DeviceAssignment) -> list[list[int]]:
    return [[d.id for d in replica] for replica in assignment.devices]


def test_topology_of_this_process() -> None:
    topology = Topology.from_devices()
    assert topology.mesh_shape == (1, 1, 1, 8) and topology.mesh_rank == 4
    assert topology.num_tasks == 1 and topology.num_tpus_per_task == 8
    assert topology.devices == (tuple(jax.local_devices()),)
    expected = np.zeros((1, 8, 4), dtype=np.int32)
    expected[0, :, 3] = np.arange(8)
    np.testing.assert_array_equal(topology.device_coordinates, expected)
    assert topology.missing_devices.shape == (0, 4)
    assert topology.device_at_coordinates([0, 0, 0, 5]) is jax.local_devices()[5]
    assert topology == Topology.from_devices(jax.local_devices())


# (computation_shape, computation_stride, num_replicas, the device ids of each replica)
_CPU_CASES = {
    "4x2": ([1, 1, 1, 2], None, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    "8x1": (None, None, 8, [[0], [1], [2], [3], [4], [5], [6], [7]]),
    "2x4": ([1, 1, 1, 4], None, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "1x8": ([1, 1, 1, 8], None, 1, [list(range(8))]),
    "2x2-of-4": ([1, 1, 1, 2], None, 2, [[0, 1], [2, 3]]),
    "3x1-of-8": (None, None, 3, [[0], [1], [2]]),
    "default": (None, None, 1, [[0]]),
    # Cores spaced by 2: footprint 4, two blocks, two replicas interleaved in each block.
    "4x2-stride2": ([1, 1, 1, 2], [1, 1, 1, 2], 4, [[0, 2], [1, 3], [4, 6], [5, 7]]),
}


@pytest.mark.parametrize(
    ("computation_shape", "computation_stride", "num_replicas", "expected"),
    list(_CPU_CASES.values()),
    ids=list(_CPU_CASES),
)
def test_build_on_cpu_devices(
    computation_shape: list[int] | None,
    computation_stride: list[int] | None,
    num_replicas: int,
    expected: list[list[int]],
) -> None:
    assignment = DeviceAssignment.build(
        computation_shape=computation_shape,
        computation_stride=computation_stride,
        num_replicas=num_replicas,
    )
    cores = len(expected[0])
    assert assignment.num_replicas == num_replicas
    assert assignment.num_cores_per_replica == cores
    assert assignment.topology == Topology.from_devices()
    assert assignment.devices.shape == (num_replicas, cores)
    assert _ids(assignment) == expected
    # On CPU a device's coordinates are (0, 0, 0, its index).
    assert assignment.core_assignment.shape == (num_replicas, cores, 4)
    assert assignment.core_assignment.dtype == np.int32
    np.testing.assert_array_equal(assignment.core_assignment[..., 3], expected)
    np.testing.assert_array_equal(assignment.core_assignment[..., :3], 0)
    devices = jax.local_devices()
    for r in range(num_replicas):
        for c in range(cores):
            assert assignment.tpu_device(r, c) is devices[expected[r][c]]
            assert assignment.tpu_device(r, c) is assignment.devices[r, c]
            assert assignment.coordinates(r, c) == (0, 0, 0, expected[r][c])
            assert assignment.tpu_ordinal(r, c) == expected[r][c]
    assert assignment.tpu_device() is devices[expected[0][0]]


@pytest.mark.parametrize(
    ("computation_shape", "computation_stride", "num_replicas"),
    [
        ([1, 1, 1, 2], None, 4),
        (None, None, 8),
        ([1, 1, 1, 4], None, 2),
        ([1, 1, 1, 8], None, 1),
        ([1, 1, 1, 2], [1, 1, 1, 2], 4),
        ([1, 1, 1, 1], [1, 1, 1, 4], 8),
    ],
)
def test_full_device_grid_covers_every_device_once(
    computation_shape: list[int] | None, computation_stride: list[int] | None, num_replicas: int
) -> None:
    assignment = DeviceAssignment.build(
        computation_shape=computation_shape,
        computation_stride=computation_stride,
        num_replicas=num_replicas,
    )
    flat = list(assignment.devices.ravel())
    assert len(flat) == len(set(flat)) == 8
    assert set(flat) == set(jax.devices())


def test_device_grid_is_a_mesh_whose_shards_land_where_assigned() -> None:
    assignment = DeviceAssignment.build(computation_shape=[1, 1, 1, 2], num_replicas=4)
    mesh = Mesh(assignment.devices, ("replica", "logical"))
    assert dict(mesh.shape) == {"replica": 4, "logical": 2}
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    placed = jax.device_put(x, NamedSharding(mesh, P("replica", "logical")))
    np.testing.assert_array_equal(np.asarray(placed), x)  # reference: the array itself
    for shard in placed.addressable_shards:
        r, c = map(int, np.argwhere(assignment.devices == shard.device)[0])
        np.testing.assert_array_equal(
            np.asarray(shard.data), x[2 * r : 2 * r + 2, 3 * c : 3 * c + 3]
        )


def test_build_on_a_subset_of_devices() -> None:
    topology = Topology.from_devices(jax.devices()[4:])
    assert topology.mesh_shape == (1, 1, 1, 4)
    assignment = DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=2)
    assert _ids(assignment) == [[4, 5], [6, 7]]
    assert assignment.coordinates(1, 1) == (0, 0, 0, 3)
    assert assignment.tpu_ordinal(1, 1) == 3


def test_lookup_replicas() -> None:
    assignment = DeviceAssignment.build(computation_shape=[1, 1, 1, 2], num_replicas=4)
    assert assignment.lookup_replicas(0, 0) == [0, 1, 2, 3]
    assert assignment.lookup_replicas(0, 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"Can not find any replica in task: 1 contains"):
        assignment.lookup_replicas(1, 0)
    with pytest.raises(ValueError, match=r"logical_core: 2"):
        assignment.lookup_replicas(0, 2)


def test_immutable_and_hashable() -> None:
    a = DeviceAssignment.build(computation_shape=[1, 1, 1, 2], num_replicas=4)
    b = DeviceAssignment.build(computation_shape=[1, 1, 1, 2], num_replicas=4)
    c = DeviceAssignment.build(computation_shape=[1, 1, 1, 2], num_replicas=2)
    assert a == b and hash(a) == hash(b) and a != c
    assert {a: 1}[b] == 1
    assert a == DeviceAssignment(a.topology, a.core_assignment)
    with pytest.raises(AttributeError, match="DeviceAssignment is immutable"):
        a.num_replicas = 3  # type: ignore[misc]
    with pytest.raises(AttributeError, match="Topology is immutable"):
        a.topology.mesh_shape = (1, 1, 1, 1)  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        a.core_assignment[0, 0, 0] = 1
    with pytest.raises(ValueError, match="read-only"):
        a.devices[0, 0] = a.devices[1, 0]
    with pytest.raises(ValueError, match="read-only"):
        a.topology.device_coordinates[0, 0, 0] = 1
    assert repr(a) == (
        "DeviceAssignment(num_replicas=4, num_cores_per_replica=2, topology=Topology("
        "mesh_shape=(1, 1, 1, 8), num_tasks=1, devices=8 cpu))"
    )


def test_public_path() -> None:
    assert jd.tpu.experimental.DeviceAssignment is DeviceAssignment
    assert jd.tpu.experimental.Topology is Topology
    assert "tpu" in jd.__all__ and "tpu" in dir(jd)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"computation_shape": [1, 1, 1, 2], "num_replicas": 5},
            r"DeviceAssignment.build: requested 5 replicas but only 4 replicas with shape "
            r"\[1, 1, 1, 2\] and computation_stride \[1, 1, 1, 1\] fit in a TPU mesh of shape "
            r"\[1, 1, 1, 8\]",
        ),
        ({"num_replicas": 9}, r"requested 9 replicas but only 8 replicas"),
        (
            {
                "computation_shape": [1, 1, 1, 2],
                "computation_stride": [1, 1, 1, 2],
                "num_replicas": 5,
            },
            r"requested 5 replicas but only 4 replicas with shape \[1, 1, 1, 2\] and "
            r"computation_stride \[1, 1, 1, 2\]",
        ),
        (
            {"computation_shape": [1, 1, 1, 0]},
            r"DeviceAssignment.build: computation_shape must be positive; got "
            r"computation_shape=\[1, 1, 1, 0\]",
        ),
        ({"computation_shape": [1, -1, 1, 2]}, r"computation_shape must be positive"),
        (
            {"computation_stride": [1, 1, 1, 0]},
            r"computation_stride must be positive; got computation_stride=\[1, 1, 1, 0\]",
        ),
        (
            {"computation_shape": [1, 1, 1, 16]},
            r"computation footprint \[1, 1, 1, 16\] \(computation_shape \* computation_stride\) "
            r"does not fit in TPU topology shape \[1, 1, 1, 8\]\. These 8 devices form a mesh of "
            r"shape \[1, 1, 1, 8\].*computation_shape=\[1, 1, 1, k\]",
        ),
        (
            {"computation_shape": [2, 1, 1, 1]},
            r"computation footprint \[2, 1, 1, 1\].*does not fit in TPU topology shape",
        ),
        (
            {"computation_shape": [1, 1, 1, 4], "computation_stride": [1, 1, 1, 4]},
            r"computation footprint \[1, 1, 1, 16\]",
        ),
        (
            {"computation_shape": [1, 1, 2]},
            r"computation_shape must have shape \[4\]; got \(3,\)\. TF's form is \[x, y, z, "
            r"cores\]",
        ),
        ({"computation_stride": [[1, 1, 1, 1]]}, r"computation_stride must have shape \[4\]"),
        ({"num_replicas": 0}, r"num_replicas must be positive; got 0"),
        ({"num_replicas": -2}, r"num_replicas must be positive; got -2"),
        ({"topology": "v3-8"}, r"`topology` is not a Topology object; got str"),
    ],
)
def test_build_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeviceAssignment.build(**kwargs)


def test_build_type_errors() -> None:
    with pytest.raises(TypeError, match=r"num_replicas must be a positive int; got 2.0"):
        DeviceAssignment.build(num_replicas=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"computation_shape must be 4 ints"):
        DeviceAssignment.build(computation_shape=[1, 1, 1, 1.5])


def test_logical_core_lookups_out_of_range() -> None:
    assignment = DeviceAssignment.build(computation_shape=[1, 1, 1, 2], num_replicas=4)
    with pytest.raises(IndexError, match=r"replica 4 is out of range; there are 4 replicas"):
        assignment.tpu_device(4, 0)
    with pytest.raises(IndexError, match=r"logical core 2 is out of range; each replica has 2"):
        assignment.coordinates(0, 2)
    with pytest.raises(IndexError, match=r"replica -1 is out of range"):
        assignment.tpu_ordinal(-1, 0)


def test_constructor_errors() -> None:
    topology = Topology.from_devices()
    with pytest.raises(ValueError, match=r"topology must be a Topology object, got list"):
        DeviceAssignment([1, 1, 1, 8], [[[0, 0, 0, 0]]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"core_assignment must be a rank 3 numpy array"):
        DeviceAssignment(topology, [[0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"must have size equal to topology rank \(4\)"):
        DeviceAssignment(topology, [[[0, 0, 0]]])
    with pytest.raises(ValueError, match=r"at least one replica"):
        DeviceAssignment(topology, np.zeros((0, 1, 4)))
    with pytest.raises(
        ValueError,
        match=r"replica 0, logical core 1 is assigned to coordinates \[0, 0, 0, 9\], where the "
        r"topology \(mesh shape \[1, 1, 1, 8\]\) has no device",
    ):
        DeviceAssignment(topology, [[[0, 0, 0, 0], [0, 0, 0, 9]]])
    with pytest.raises(
        ValueError, match=r"\(0, 1\) and \(1, 0\) are both assigned to .*every logical core"
    ):
        DeviceAssignment(topology, [[[0, 0, 0, 0], [0, 0, 0, 1]], [[0, 0, 0, 1], [0, 0, 0, 2]]])


def test_topology_errors() -> None:
    devices = jax.devices()
    with pytest.raises(ValueError, match=r"`mesh_shape` must be a sequence of 4 positive"):
        Topology([1, 1, 8], [[[0, 0, 0]]], [[devices[0]]])
    with pytest.raises(ValueError, match=r"`mesh_shape` must be a sequence of 4 positive"):
        Topology([1, 1, 0, 8], [[[0, 0, 0, 0]]], [[devices[0]]])
    with pytest.raises(ValueError, match=r"`device_coordinates` must be a rank 3 int array"):
        Topology([1, 1, 1, 8], [[0, 0, 0, 0]], [[devices[0]]])
    with pytest.raises(
        ValueError, match=r"device \(0, 1\) has coordinates \[0, 0, 0, 8\], outside"
    ):
        Topology([1, 1, 1, 8], [[[0, 0, 0, 0], [0, 0, 0, 8]]], [devices[:2]])
    with pytest.raises(ValueError, match=r"share the coordinates \[0, 0, 0, 0\]"):
        Topology([1, 1, 1, 8], [[[0, 0, 0, 0], [0, 0, 0, 0]]], [devices[:2]])
    with pytest.raises(ValueError, match=r"`devices` must be laid out as `device_coordinates`"):
        Topology([1, 1, 1, 8], [[[0, 0, 0, 0], [0, 0, 0, 1]]], [devices[:3]])
    with pytest.raises(ValueError, match=r"`devices` must be unique"):
        Topology([1, 1, 1, 8], [[[0, 0, 0, 0], [0, 0, 0, 1]]], [[devices[0], devices[0]]])
    with pytest.raises(ValueError, match=r"the list of devices is empty"):
        Topology.from_devices([])
    with pytest.raises(ValueError, match=r"no device at coordinates \[0, 0, 0, 3\]"):
        Topology.from_devices(devices[:2]).device_at_coordinates([0, 0, 0, 3])


# --- a topology with holes: devices in task order -----------------------------------------


def test_missing_devices_take_devices_in_task_order() -> None:
    devices = jax.devices()[:6]
    places = [0, 1, 2, 3, 5, 6]  # cells 4 and 7 of the (1, 1, 1, 8) mesh hold no device
    coords = [[[0, 0, 0, k] for k in places]]
    topology = Topology([1, 1, 1, 8], coords, [devices])
    np.testing.assert_array_equal(topology.missing_devices, [[0, 0, 0, 4], [0, 0, 0, 7]])
    assignment = DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=3)
    assert _ids(assignment) == [[0, 1], [2, 3], [4, 5]]
    np.testing.assert_array_equal(assignment.core_assignment[..., 3], [[0, 1], [2, 3], [5, 6]])
    with pytest.raises(
        ValueError, match=r"requested 4 replicas of 2 cores but the topology has only 6 devices"
    ):
        DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=4)
    with pytest.raises(ValueError, match=r"2 missing devices; computation_stride must then be all"):
        DeviceAssignment.build(topology, [1, 1, 1, 1], [1, 1, 1, 2], num_replicas=2)


# --- TPU devices: physical coordinates and TF's rings -------------------------------------


@dataclasses.dataclass(frozen=True)
class _FakeTpu:
    """Stands in for a TPU `jax.Device`: the attributes a topology reads."""

    id: int
    coords: tuple[int, int, int]
    core_on_chip: int
    process_index: int = 0
    platform: str = "tpu"


def _tpu_slice(x: int, y: int, z: int, cores: int, x0: int = 0) -> list[_FakeTpu]:
    """A slice of x*y*z chips with ``cores`` cores each, in jax's id order; x starts at x0."""
    chips = [(i, j, k) for k in range(z) for j in range(y) for i in range(x)]
    return [
        _FakeTpu(id=n * cores + c, coords=(i + x0, j, k), core_on_chip=c)
        for n, (i, j, k) in enumerate(chips)
        for c in range(cores)
    ]


def test_tpu_topology_from_physical_coordinates() -> None:
    devices = _tpu_slice(2, 2, 1, 2, x0=4)  # a host whose chips start at x = 4
    topology = Topology.from_devices(devices)
    assert topology.mesh_shape == (2, 2, 1, 2)
    assert topology.device_at_coordinates([1, 0, 0, 1]) == _FakeTpu(3, (5, 0, 0), 1)
    assert topology.missing_devices.size == 0
    assert repr(topology) == "Topology(mesh_shape=(2, 2, 1, 2), num_tasks=1, devices=8 tpu)"


def _chips(assignment: DeviceAssignment) -> list[list[tuple[int, ...]]]:
    return [[tuple(c) for c in replica.tolist()] for replica in assignment.core_assignment]


def test_tpu_whole_chip_replicas_follow_a_ring() -> None:
    topology = Topology.from_devices(_tpu_slice(2, 2, 1, 2))
    # One chip (both cores) per replica, all 4 chips used: replicas go round the 2x2 ring.
    assignment = DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=4)
    assert _chips(assignment) == [
        [(0, 0, 0, 0), (0, 0, 0, 1)],
        [(1, 0, 0, 0), (1, 0, 0, 1)],
        [(1, 1, 0, 0), (1, 1, 0, 1)],
        [(0, 1, 0, 0), (0, 1, 0, 1)],
    ]
    # One replica of all chips: its logical cores go round the ring, both cores of a chip
    # next to each other.
    whole = DeviceAssignment.build(topology, [2, 2, 1, 2], num_replicas=1)
    assert _chips(whole) == [
        [
            (0, 0, 0, 0),
            (0, 0, 0, 1),
            (1, 0, 0, 0),
            (1, 0, 0, 1),
            (1, 1, 0, 0),
            (1, 1, 0, 1),
            (0, 1, 0, 0),
            (0, 1, 0, 1),
        ]
    ]


def test_tpu_core_replicas_fill_the_core_axis_first() -> None:
    topology = Topology.from_devices(_tpu_slice(2, 2, 1, 2))
    # One core per replica: the replica grid is (2, 2, 1, 2); replicas visit the two cores
    # of a chip, then x, then y.
    assignment = DeviceAssignment.build(topology, num_replicas=8)
    assert [c[0] for c in _chips(assignment)] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (1, 0, 0, 0),
        (1, 0, 0, 1),
        (0, 1, 0, 0),
        (0, 1, 0, 1),
        (1, 1, 0, 0),
        (1, 1, 0, 1),
    ]
    # Two replicas of a 2x1 block of chips each (4 cores): the blocks stack along y.
    pairs = DeviceAssignment.build(topology, [2, 1, 1, 2], num_replicas=2)
    assert _chips(pairs)[1] == [(0, 1, 0, 0), (0, 1, 0, 1), (1, 1, 0, 0), (1, 1, 0, 1)]
    assert {d.id for d in pairs.devices.ravel()} == set(range(8))


def test_tpu_replica_grid_prefers_the_cores_of_a_chip_then_x() -> None:
    # TF's own example: 4 one-core replicas on a 2x2x2 slice of 2-core chips take a replica
    # grid of (2, 1, 1, 2) (both cores of two chips along x), not (1, 1, 2, 2).
    topology = Topology.from_devices(_tpu_slice(2, 2, 2, 2))
    assignment = DeviceAssignment.build(topology, num_replicas=4)
    assert [c[0] for c in _chips(assignment)] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (1, 0, 0, 0),
        (1, 0, 0, 1),
    ]


# TF's drawings of its ring orders (tensorflow/python/tpu/device_assignment.py): the number
# at row y, column x of plane z is the position of chip (x, y, z) in the ring.
_RING_4X4 = [
    [0, 1, 2, 3],
    [15, 6, 5, 4],
    [14, 7, 8, 9],
    [13, 12, 11, 10],
]
_RING_4X4X4 = [
    _RING_4X4,
    [[63, 30, 29, 28], [16, 25, 26, 27], [17, 24, 23, 22], [18, 19, 20, 21]],
    [[62, 31, 32, 33], [45, 36, 35, 34], [44, 37, 38, 39], [43, 42, 41, 40]],
    [[61, 60, 59, 58], [46, 55, 56, 57], [47, 54, 53, 52], [48, 49, 50, 51]],
]


def _positions(ring: list[tuple[int, int, int]], shape: tuple[int, int, int]) -> np.ndarray:
    x, y, z = shape
    grid = np.full((z, y, x), -1)
    for position, (i, j, k) in enumerate(ring):
        grid[k, j, i] = position
    return grid


def test_rings_are_tfs() -> None:
    np.testing.assert_array_equal(_positions(ring_3d(4, 4, 1), (4, 4, 1)), [_RING_4X4])
    np.testing.assert_array_equal(_positions(ring_3d(4, 4, 4), (4, 4, 4)), _RING_4X4X4)


@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 4), (3, 2, 1)],
)
def test_rings_visit_every_chip_once_from_the_origin(shape: tuple[int, int, int]) -> None:
    ring = ring_3d(*shape)
    assert ring[0] == (0, 0, 0)
    assert sorted(ring) == sorted(np.ndindex(*shape))
    if shape == (3, 2, 1):
        return  # an odd size: no ring, plain order (next test)
    distance = [int(np.abs(np.subtract(a, b)).sum()) for a, b in itertools.pairwise(ring)]
    assert all(d == 1 for d in distance)  # consecutive chips are neighbours
    if sum(s > 1 for s in shape) >= 2:  # a closed ring: the last chip neighbours the first
        assert int(np.abs(np.subtract(ring[-1], ring[0])).sum()) == 1


def test_odd_sizes_fall_back_to_x_fastest_order() -> None:
    assert ring_3d(3, 2, 1) == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0), (1, 1, 0), (2, 1, 0)]


def test_unequal_tasks_are_rejected() -> None:
    devices = [dataclasses.replace(d, process_index=int(d.id >= 6)) for d in _tpu_slice(2, 2, 1, 2)]
    with pytest.raises(
        ValueError, match=r"every process \(task\) must contribute the same number of devices"
    ):
        Topology.from_devices(devices)
    two_tasks = [
        dataclasses.replace(d, process_index=int(d.id >= 4)) for d in _tpu_slice(2, 2, 1, 2)
    ]
    topology = Topology.from_devices(two_tasks)
    assert (topology.num_tasks, topology.num_tpus_per_task) == (2, 4)
    assignment = DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=4)
    # Replicas 0 and 1 sit on chips (0, 0) and (1, 0), held by task 0; 2 and 3 on task 1.
    assert assignment.lookup_replicas(0, 0) == [0, 1]
    assert assignment.lookup_replicas(1, 1) == [2, 3]
