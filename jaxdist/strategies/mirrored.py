"""`MirroredStrategy`: synchronous data parallelism over the devices of this process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxdist.collectives.cross_device_ops import CrossDeviceOps
from jaxdist.devices import resolve_devices
from jaxdist.strategies.base import AXIS_NAME, Strategy

__all__ = ["MirroredStrategy"]


class MirroredStrategy(Strategy):
    """One replica per device; variables mirrored, gradients all-reduced.

    Args:
        devices: the devices to replicate over (`jax.Device` objects, indices
            or strings like ``"/gpu:0"``); ``None`` means every local device.
        cross_device_ops: how all-reduces are lowered; ``None`` means
            `NcclAllReduce` (one XLA all-reduce per packed buffer).
        mesh_shape: lay the replicas out on a mesh of this shape (row-major
            over ``devices``), e.g. ``(2, 4)``; ``None``: one axis.
        axis_names: the names of the mesh axes, outermost first (default
            ``("replica",)``); with several, the replica axis is all of them and
            `HierarchicalCopyAllReduce` reduces within the innermost first.

    Example:
        >>> import jax, jaxdist as jd
        >>> jd.MirroredStrategy().num_replicas_in_sync == jax.local_device_count()
        True
    """

    __slots__ = ()

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        *,
        mesh_shape: tuple[int, ...] | None = None,
        axis_names: tuple[str, ...] = (AXIS_NAME,),
    ) -> None:
        super().__init__(
            resolve_devices(devices, where="MirroredStrategy(devices=...)"),
            cross_device_ops,
            mesh_shape=mesh_shape,
            axis_names=axis_names,
        )
