"""Where cross-replica results go: destination shardings, placing a result on every
destination device, broadcasting, and the replica count of values given without a strategy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxdist import _cpu_gate
from jaxdist._jax_compat import is_tracer
from jaxdist.devices import resolve_device
from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica
from jaxdist.variables import Variable, is_distributed

# Destinations -----------------------------------------------------------------------


def _replicated_on(devices: Sequence[jax.Device], default: Any) -> jax.sharding.Sharding:
    if len(devices) == 1:
        return SingleDeviceSharding(devices[0])
    if default is not None and set(default.device_set) == set(devices):
        return default  # the strategy's own mesh: results feed straight back into run
    return NamedSharding(Mesh(np.array(devices, dtype=object), ("replica",)), P())


def destination_sharding(destinations: Any, *, where: str, default: Any = None) -> Any:
    """Where a cross-replica result goes: a replicated `jax.sharding.Sharding` (private).

    ``destinations`` is a device (or a spec like ``"/cpu:0"``), a list of them, a
    distributed value, variable or array (its devices), or ``None`` (``default``).
    Returns ``default`` for traced destinations (inside a ``merge_fn``), whose
    devices are those of the running strategy.
    """
    arg = f"{where}(destinations=...)"
    if destinations is None:
        if default is None:
            raise ValueError(
                f"{arg}: destinations is None. Say where the result goes: a device "
                "(jax.Device, '/cpu:0', an index), a list of devices, or a distributed value "
                "or variable (its devices; pass the reduced value itself for an all-reduce)."
            )
        return default
    target = destinations
    if isinstance(target, Variable):
        target = target.device_values
    elif isinstance(target, DistributedValues):
        target = target.array
        if default is not None and device_count(target) == 1:
            # A distributed value lives on every replica, wherever its host-built array
            # happens to sit (PerReplica([...]) is on one device until run places it).
            return default
    if is_tracer(target):
        return default
    if isinstance(target, jax.Array):
        sharding = target.sharding
        if len(sharding.device_set) > 1 and isinstance(sharding, NamedSharding):
            return sharding if sharding.is_fully_replicated else NamedSharding(sharding.mesh, P())
        return _replicated_on(sorted(sharding.device_set, key=lambda d: d.id), default)
    if isinstance(target, (list, tuple)):
        if not target:
            raise ValueError(f"{arg}: the list of destination devices is empty.")
        devices = [resolve_device(d, where=arg) for d in target]
        if len(set(devices)) != len(devices):
            raise ValueError(f"{arg}: destination devices must be unique, got {list(target)!r}.")
        return _replicated_on(devices, default)
    if isinstance(target, (jax.Device, str, int)) and not isinstance(target, bool):
        return SingleDeviceSharding(resolve_device(target, where=arg))
    if default is not None and isinstance(target, np.ndarray):
        return default  # host data (a PerReplica built from NumPy): the strategy's devices
    raise TypeError(
        f"{arg}: cannot place a result on {type(destinations).__name__} ({destinations!r:.60}). "
        "Use a device (jax.Device, '/gpu:0', an index), a list of devices, or a "
        "PerReplica / Mirrored / Variable / jax.Array (its devices)."
    )


def first_device(sharding: Any) -> jax.Device:
    if isinstance(sharding, NamedSharding):
        return sharding.mesh.devices.flat[0]
    return min(sharding.device_set, key=lambda d: d.id)


def place(x: Any, target: Any) -> Any:
    """``x`` copied to every device of ``target``: `Mirrored` over several, plain on one."""
    if target is None:
        return Mirrored(x)
    if not is_tracer(x):
        x = jax.device_put(x, target)
    return Mirrored(x) if len(target.device_set) > 1 else x


def device_count(x: Any) -> int:
    return len(x.sharding.device_set) if isinstance(x, jax.Array) and not is_tracer(x) else 1


def gate_for(leaves: Sequence[Any]) -> bool:
    for x in leaves:
        arr = x.array if isinstance(x, DistributedValues) else x
        if (
            isinstance(arr, jax.Array)
            and not is_tracer(arr)
            and _cpu_gate.needs_gate(tuple(arr.sharding.device_set))
        ):
            return True
    return False


def replica_count(where: str, leaves: Sequence[Any]) -> int:
    """The replica count of distributed leaves given without a strategy: their rows
    (`PerReplica`) or devices (`Mirrored`), which must agree."""
    counts = {
        x.array.shape[0] if isinstance(x, PerReplica) else device_count(x.array)
        for x in leaves
        if isinstance(x, DistributedValues)
    }
    if len(counts) > 1:
        raise ValueError(
            f"{where}: the values have different replica counts {sorted(counts)} (PerReplica "
            "rows, Mirrored devices); reduce values of one strategy together, or call "
            "strategy.extended.batch_reduce_to, which knows the strategy's count."
        )
    return counts.pop() if counts else 1


def check_pairs(value_destination_pairs: Any, where: str) -> list[tuple[Any, Any]]:
    """``value_destination_pairs`` as a list of 2-tuples (private)."""
    if not isinstance(value_destination_pairs, (list, tuple)):
        raise TypeError(
            f"{where}: value_destination_pairs must be a list of (value, destinations) pairs, "
            f"got {type(value_destination_pairs).__name__}. For one value use reduce / reduce_to."
        )
    pairs = []
    for i, pair in enumerate(value_destination_pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(
                f"{where}: value_destination_pairs[{i}] must be a (value, destinations) pair, "
                f"got {type(pair).__name__} ({pair!r:.60}). Write [(grad, grad), (loss, '/cpu:0')]."
            )
        pairs.append((pair[0], pair[1]))
    return pairs


def broadcast_to(where: str, tensor: Any, target: Any) -> Any:
    """Places every leaf of ``tensor`` on ``target`` (private; see `CrossDeviceOps.broadcast`)."""

    def one(path: Any, x: Any) -> Any:
        if isinstance(x, PerReplica):
            raise TypeError(
                f"{where}: tensor{jax.tree_util.keystr(path)} is a PerReplica (shape "
                f"{x.shape}), which has one value per replica and none to broadcast. Reduce "
                "it first (reduce / reduce_to), or broadcast one replica's value."
            )
        if isinstance(x, Variable):
            x = x.read_value()
        elif isinstance(x, Mirrored):
            x = x.array
        return place(jnp.asarray(x), target)

    return jax.tree_util.tree_map_with_path(one, tensor, is_leaf=is_distributed)
