"""`CentralStorageStrategy`: variables on one device, compute replicated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxdist.devices import resolve_device, resolve_devices
from jaxdist.strategies.base import Strategy

__all__ = ["CentralStorageStrategy"]


class CentralStorageStrategy(Strategy):
    """Mirrored (``ON_WRITE``) variables live on one parameter device; every step
    copies them to the compute devices, and their reduced updates go back there.

    Args:
        compute_devices: devices that run replicas (``None``: every local device).
        parameter_device: the device holding variables. ``None`` means the one
            compute device when there is one, else the first CPU device (as
            tf.distribute does).

    Results equal `MirroredStrategy`'s on the same step; only placement differs.
    """

    __slots__ = ("_parameter_device",)
    _parameter_device: jax.Device

    def __init__(
        self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None
    ) -> None:
        where = "CentralStorageStrategy"
        devices = resolve_devices(compute_devices, where=f"{where}(compute_devices=...)")
        if parameter_device is None:
            param = devices[0] if len(devices) == 1 else jax.local_devices(backend="cpu")[0]
        else:
            param = resolve_device(parameter_device, where=f"{where}(parameter_device=...)")
        object.__setattr__(self, "_parameter_device", param)
        super().__init__(devices)

    def extra_key(self) -> tuple[Any, ...]:
        return (self._parameter_device,)

    @property
    def parameter_device(self) -> jax.Device:
        return self._parameter_device
