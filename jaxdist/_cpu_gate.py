"""Bounding in-flight multi-device programs on the CPU backend.

XLA's CPU runtime deadlocks when a second program with cross-device
collectives is dispatched while an earlier one is still running on the same
simulated devices (threads wait forever at a rendezvous). Before jaxdist
dispatches such a program on CPU it waits for the previous one's outputs, so
at most one is in flight; Python still overlaps with that one program. GPU
and TPU programs are never waited on: asynchronous dispatch is what makes
them fast there.

`gated` / `gated_call` hold one lock around wait, dispatch and record, so
programs dispatched from several threads are serialized too. The wait itself is one
``block_until_ready`` on one output array of the previous program (all of a
program's outputs become ready together).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

import jax

from jaxdist._jax_compat import concrete_array_type, is_tracer
from jaxdist.values.distributed import Mirrored, PerReplica

_lock = threading.RLock()
_last: list[Any] = [None]  # one output array of the last gated program
_ARRAY = concrete_array_type()
_WRAPPED = (Mirrored, PerReplica)


def needs_gate(devices: Any) -> bool:
    """True when programs over ``devices`` must not overlap (several CPU devices)."""
    return len(devices) > 1 and devices[0].platform == "cpu"


def _an_array(outputs: Any) -> Any:
    """One concrete output array of a program (None if there is none)."""
    if isinstance(outputs, jax.Array):
        return None if is_tracer(outputs) else outputs
    array = getattr(outputs, "array", None)  # a Mirrored / PerReplica
    if isinstance(array, jax.Array):
        return None if is_tracer(array) else array
    for leaf in jax.tree.leaves(outputs):
        if isinstance(leaf, jax.Array):
            return None if is_tracer(leaf) else leaf
    return None


def gated_call(
    call: Callable[[Any, Any], Any],
    args: Any,
    kwargs: Any,
    recover: Callable[[Any, Any, Exception], Any] | None = None,
) -> Any:
    """Waits for the previous gated program, runs ``call(args, kwargs)``, remembers its
    outputs. The per-call path of a cached `Strategy.run` / `Strategy.function` on CPU
    (no closure is made per call). With ``recover``, a ``TypeError`` / ``ValueError``
    from ``call`` goes to ``recover(args, kwargs, error)`` (a better error, or the call
    retried), still under the gate."""
    with _lock:
        prev = _last[0]
        if prev is not None:
            _last[0] = None
            prev.block_until_ready()
        try:
            out = call(args, kwargs)
        except (TypeError, ValueError) as e:
            if recover is None:
                raise
            out = recover(args, kwargs, e)
        # The common outputs (one array, one Mirrored / PerReplica) without a tree walk.
        leaf = out.array if type(out) in _WRAPPED else out
        if type(leaf) is not _ARRAY:
            leaf = _an_array(out)
        if leaf is not None:
            _last[0] = leaf
        return out


def caller(
    call: Callable[[Any, Any], Any],
    recover: Callable[[Any, Any, Exception], Any],
    state: contextvars.ContextVar[Any],
    nested: Callable[[bool], Exception],
    *,
    gate: bool,
) -> Callable[[Any, Any], Any]:
    """``caller(args, kwargs)``: ``call(args, kwargs)`` (under the gate if ``gate``), the
    per-call path of a cached `Strategy.run` / `Strategy.function`, chosen once per
    program. A ``TypeError`` / ``ValueError`` from ``call`` goes to ``recover(args,
    kwargs, error)``; a call inside a replica function (``state``'s ``replica`` is set)
    raises ``nested(merging)``."""

    def gated_caller(args: Any, kwargs: Any) -> Any:
        current = state.get()
        if current.replica is not None:
            raise nested(current.merging)
        return gated_call(call, args, kwargs, recover)

    def direct_caller(args: Any, kwargs: Any) -> Any:
        current = state.get()
        if current.replica is not None:
            raise nested(current.merging)
        try:
            return call(args, kwargs)
        except (TypeError, ValueError) as e:
            return recover(args, kwargs, e)

    return gated_caller if gate else direct_caller


def gated(dispatch: Callable[[], Any]) -> Any:
    """Waits for the previous gated program, runs ``dispatch()``, remembers its outputs."""
    return gated_call(_call_thunk, dispatch, None)


def _call_thunk(thunk: Callable[[], Any], _: Any) -> Any:
    return thunk()
