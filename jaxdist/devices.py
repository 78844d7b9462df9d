"""Turning tf.distribute-style device specs into `jax.Device` objects.

Accepted: a `jax.Device`; an int (index into `jax.devices()`); a string such as
``"/gpu:0"``, ``"GPU:1"``, ``"/device:CPU:3"`` or
``"/job:worker/replica:0/task:0/device:TPU:1"`` (the platform and index are
what count; ``"/cpu:3"`` is the fourth CPU device).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax

# The mesh axis of a replica's logical devices (`TPUStrategy`); the replica axes are
# the others. Values on such a mesh have one component per replica, on its logical
# device 0.
LOGICAL_AXIS_NAME = "logical"

_SPEC = re.compile(r"(?:^|/)(?:device:)?(?P<kind>[A-Za-z_]+):(?P<index>\d+)$")


def _available() -> str:
    return ", ".join(f"{d.platform}:{d.id}" for d in jax.devices())


def resolve_device(spec: Any, *, where: str) -> jax.Device:
    """Returns the `jax.Device` that ``spec`` names; raises ``ValueError`` if none."""
    if isinstance(spec, jax.Device):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        devices = jax.devices()
        if 0 <= spec < len(devices):
            return devices[spec]
        raise ValueError(f"{where}: device index {spec} is out of range; devices: {_available()}.")
    if isinstance(spec, str):
        m = _SPEC.search(spec.strip())
        if m:
            kind, index = m["kind"].lower(), int(m["index"])
            try:
                candidates = jax.devices(kind)
            except RuntimeError:
                candidates = []
            matches = [d for d in candidates if d.id == index] or (
                [candidates[index]] if index < len(candidates) else []
            )
            if matches:
                return matches[0]
        raise ValueError(
            f"{where}: no device matches {spec!r}. Available devices: {_available()}. Use a "
            "jax.Device, an index into jax.devices(), or a string like '/gpu:0'."
        )
    raise TypeError(
        f"{where}: a device must be a jax.Device, an int or a string like '/gpu:0', got "
        f"{type(spec).__name__}."
    )


def resolve_devices(specs: Sequence[Any] | None, *, where: str) -> tuple[jax.Device, ...]:
    """Resolves a list of device specs (``None``: every device of this process)."""
    if specs is None:
        return tuple(jax.local_devices())
    if isinstance(specs, (str, jax.Device)):
        specs = [specs]
    devices = tuple(resolve_device(s, where=where) for s in specs)
    if not devices:
        raise ValueError(f"{where}: the list of devices is empty; pass None for every device.")
    if len(set(devices)) != len(devices):
        raise ValueError(f"{where}: devices must be unique, got {list(specs)!r}.")
    return devices
