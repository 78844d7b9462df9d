"""Bounding in-flight multi-device programs on the CPU backend (private).

XLA's CPU runtime deadlocks when a second program with cross-device
collectives is dispatched while an earlier one is still running on the same
simulated devices (threads wait forever at a rendezvous). Before jaxdist
dispatches such a program on CPU it waits for the previous one's outputs, so
at most one is in flight; Python still overlaps with that one program. GPU
and TPU programs are never waited on: asynchronous dispatch is what makes
them fast there.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax

from jaxdist._jax_compat import is_tracer

_lock = threading.Lock()
_pending: list[Any] = []


def needs_gate(devices: Sequence[jax.Device]) -> bool:
    """True when programs over ``devices`` must not overlap (several CPU devices)."""
    return len(devices) > 1 and devices[0].platform == "cpu"


def wait_for_previous() -> None:
    """Blocks until the last gated program's outputs are ready."""
    with _lock:
        pending = list(_pending)
        _pending.clear()
    if pending:
        jax.block_until_ready(pending)


def record(outputs: Any) -> None:
    """Remembers ``outputs`` of a just-dispatched gated program (tracers are ignored)."""
    for leaf in jax.tree.leaves(outputs):
        if isinstance(leaf, jax.Array) and not is_tracer(leaf):
            with _lock:
                _pending[:] = [leaf]
            return
