"""`OneDeviceStrategy`: the strategy API on a single device."""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.devices import resolve_device
from jaxdist.strategies.base import Strategy

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """Runs everything on one device: one replica, collectives are identities.

    Useful to write code once and switch to `MirroredStrategy` later.

    Args:
        device: a `jax.Device`, an index into `jax.devices()`, or a string such
            as ``"/gpu:0"``; ``None`` means the first device.

    Example:
        >>> import jaxdist as jd
        >>> jd.OneDeviceStrategy().num_replicas_in_sync
        1
    """

    __slots__ = ()

    def __init__(self, device: Any = None) -> None:
        dev = (
            jax.devices()[0]
            if device is None
            else resolve_device(device, where="OneDeviceStrategy(device=...)")
        )
        super().__init__((dev,))

    @property
    def device(self) -> jax.Device:
        return self._devices[0]
