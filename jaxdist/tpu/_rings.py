"""Ring orders through a 3-D grid of chips (used by `DeviceAssignment.build`).

TensorFlow places the chips of a replica, and the replicas of a fully
replicated computation, along closed rings through the chip mesh, so that
neighbours in the order are neighbours on the interconnect. These functions
give TF's orders (the layouts drawn in ``tensorflow/python/tpu/
device_assignment.py``).
"""

from __future__ import annotations

__all__ = ["ring_3d"]

Chip = tuple[int, int, int]


def _open_ring_2d(x_size: int, y_size: int, z: int) -> list[Chip]:
    """A ring through an ``x_size`` by ``y_size`` plane at height ``z``, without (0, 0).

    It snakes through rows two at a time, out along the even row and back
    along the odd one, never entering column 0, and returns home down
    column 0. ``y_size`` must be even.
    """
    ring: list[Chip] = []
    for pair in range(y_size // 2):
        ring += [(x, 2 * pair, z) for x in range(1, x_size)]
        ring += [(x, 2 * pair + 1, z) for x in range(x_size - 1, 0, -1)]
    ring += [(0, y, z) for y in range(y_size - 1, 0, -1)]
    return ring


def _on_axis(axis: int, i: int) -> Chip:
    return (i if axis == 0 else 0, i if axis == 1 else 0, i if axis == 2 else 0)


def ring_3d(x_size: int, y_size: int, z_size: int) -> list[Chip]:
    """Every chip of an ``x_size * y_size * z_size`` grid once, in ring order, from (0, 0, 0).

    A line when at most one size exceeds 1; plain x-fastest order when a
    size is odd (no closed ring exists); a 2-D ring when one size is 1;
    otherwise 2-D rings on each z plane, alternately reversed, joined at
    column (0, 0) and closed back down it.
    """
    sizes = (x_size, y_size, z_size)
    long_axes = [axis for axis, size in enumerate(sizes) if size > 1]
    if len(long_axes) <= 1:
        axis = long_axes[0] if long_axes else 0
        return [_on_axis(axis, i) for i in range(sizes[axis])]
    if any(size > 1 and size % 2 for size in sizes):
        return [(x, y, z) for z in range(z_size) for y in range(y_size) for x in range(x_size)]
    if z_size == 1:
        return [(0, 0, 0), *_open_ring_2d(x_size, y_size, 0)]
    if y_size == 1:  # the ring runs in the x-z plane
        return [(0, 0, 0), *((x, 0, z) for x, z, _ in _open_ring_2d(x_size, z_size, 0))]
    if x_size == 1:  # the ring runs in the y-z plane
        return [(0, 0, 0), *((0, y, z) for y, z, _ in _open_ring_2d(y_size, z_size, 0))]
    ring: list[Chip] = [(0, 0, 0)]
    for z in range(z_size):
        plane = _open_ring_2d(x_size, y_size, z)
        ring += plane if z % 2 == 0 else plane[::-1]
    ring += [(0, 0, z) for z in range(z_size - 1, 0, -1)]
    return ring
