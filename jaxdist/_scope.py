"""The scope state: which strategy is in effect, and whether a replica function is being
traced (the shims `get_strategy`, `has_strategy`, ... are public through
``jaxdist``).

Everything reads one immutable `_State` held in a `contextvars.ContextVar`; there
is no other global state. This module sits low in the layers (values and
variables ask it for the current strategy), so it knows strategies only through
`jaxdist._protocols.StrategyLike`.

The one late-bound hook in jaxdist lives here: the *default* strategy (one
device, what `get_strategy()` returns outside every scope) is defined near the
top of the layers (`jaxdist.strategies.default_strategy`), registers itself here when it
is imported, and is imported by name at the first call that needs it. No other
module imports upwards (an import-linter contract in ``make test`` holds that).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import threading
import warnings
from collections.abc import Callable, Iterator

from jaxdist._protocols import ReplicaContextLike, StrategyLike
from jaxdist.errors import StrategyMixingError

__all__ = [
    "check_cross_replica",
    "current_replica_context",
    "current_state",
    "experimental_set_strategy",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "register_default_strategy",
    "replica_scope",
    "strategy_scope",
]


@dataclasses.dataclass(frozen=True)
class _State:
    strategy: StrategyLike | None = None
    replica: ReplicaContextLike | None = None
    merging: bool = False
    scope_depth: int = 0


STATE: contextvars.ContextVar[_State] = contextvars.ContextVar("jaxdist_state", default=_State())  # noqa: B039 (frozen)


def current_state() -> _State:
    """The calling context's state (private)."""
    return STATE.get()


@contextlib.contextmanager
def entered(state: _State) -> Iterator[None]:
    token = STATE.set(state)
    try:
        yield
    finally:
        STATE.reset(token)


def _mixing_error(where: str, current: StrategyLike, new: StrategyLike) -> RuntimeError:
    return StrategyMixingError(
        f"{where}: mixing different strategies is not allowed: {current!r} is already in "
        f"effect and {new!r} was asked for. Leave the first strategy's scope (or call "
        "jaxdist.experimental_set_strategy(None)) before using the second."
    )


@contextlib.contextmanager
def strategy_scope(strategy: StrategyLike) -> Iterator[StrategyLike]:
    """Implements `Strategy.scope()` (private; use the method).

    The default strategy's scope changes nothing but the depth, as in TF: it is entered in
    the default replica context and stays there (``in_cross_replica_context()`` is False),
    and another strategy's scope may be entered inside it; it cannot be entered inside
    another strategy's scope.
    """
    state = STATE.get()
    if state.strategy is not None and state.strategy != strategy:
        raise _mixing_error(f"{type(strategy).__name__}.scope()", state.strategy, strategy)
    if state.replica is not None and not state.merging:  # TF: cross-replica context only
        raise RuntimeError(
            f"{type(strategy).__name__}.scope() was entered inside a replica function; a "
            "scope is cross-replica context (as in TF). Enter it around the code that calls "
            "run (create variables and models there), or in a merge_fn."
        )
    if _is_default(strategy):
        with entered(dataclasses.replace(state, scope_depth=state.scope_depth + 1)):
            yield strategy
        return
    me = threading.get_ident()
    with _scopes_lock:
        _SCOPES_BY_THREAD.setdefault(me, []).append(strategy)
    try:
        with entered(
            dataclasses.replace(state, strategy=strategy, scope_depth=state.scope_depth + 1)
        ):
            yield strategy
    finally:
        with _scopes_lock:
            stack = _SCOPES_BY_THREAD[me]
            stack.pop()
            if not stack:
                del _SCOPES_BY_THREAD[me]


# Threads currently inside a strategy scope (a scope does not reach threads started
# inside it: contextvars are per thread). Used only to explain that.
_SCOPES_BY_THREAD: dict[int, list[StrategyLike]] = {}
_scopes_lock = threading.Lock()
# Set in a thread once it was warned (a thread-local, not a set of thread idents: the
# runtime gives the ident of a finished thread to a new one).
_warned = threading.local()


def _warn_if_scoped_elsewhere() -> None:
    if getattr(_warned, "done", False):
        return
    me = threading.get_ident()
    with _scopes_lock:
        others = [(t, st[-1]) for t, st in _SCOPES_BY_THREAD.items() if t != me]
    if not others:
        return
    _warned.done = True
    names = {t.ident: t.name for t in threading.enumerate()}
    where = ", ".join(f"{s!r} in thread {names.get(t, t)!r}" for t, s in others)
    warnings.warn(
        f"jaxdist: thread {threading.current_thread().name!r} is in no strategy scope, so it "
        f"uses the default strategy (one device), while a scope is active elsewhere: {where}. "
        "A strategy scope does not carry over to threads started inside it (contextvars are "
        "per thread). Enter `with strategy.scope():` inside the thread, or start it with "
        "contextvars.copy_context().run(...).",
        RuntimeWarning,
        stacklevel=3,
    )


@contextlib.contextmanager
def replica_scope(ctx: ReplicaContextLike) -> Iterator[None]:
    """Marks the tracing of a replica function (private)."""
    state = STATE.get()
    if state.strategy is not None and state.strategy != ctx.strategy and state.replica is None:
        raise _mixing_error(f"{type(ctx.strategy).__name__}.run", state.strategy, ctx.strategy)
    with entered(dataclasses.replace(state, strategy=ctx.strategy, replica=ctx, merging=False)):
        yield


def check_cross_replica(strategy: StrategyLike, method: str) -> None:
    """Raises `RuntimeError` when a cross-replica method is called from replica context,
    or (`StrategyMixingError`, as TF) while another strategy is in effect."""
    state = STATE.get()
    name = type(strategy).__name__
    if state.strategy is not None and state.strategy != strategy:
        raise _mixing_error(f"{name}.{method}", state.strategy, strategy)
    if state.replica is not None and not state.merging:
        raise RuntimeError(
            f"{name}.{method} was called inside a replica function, where only the replica "
            f"context's collectives apply. Inside the function use ctx.all_reduce / "
            f"ctx.all_gather, or call {name}.{method} on the function's outputs after run "
            "returns (or from a merge_fn given to ctx.merge_call)."
        )


# The default strategy: the one late-bound hook -------------------------------------

_DEFAULT: list[tuple[Callable[[], StrategyLike], type]] = []


def register_default_strategy(factory: Callable[[], StrategyLike], cls: type) -> None:
    """Called by `jaxdist.strategies.default_strategy` when it is imported (private)."""
    _DEFAULT[:] = [(factory, cls)]


def default_strategy() -> StrategyLike:
    if not _DEFAULT:
        # The one late-bound lookup (see the module docstring): the default strategy's
        # module registers itself when imported.
        importlib.import_module("jaxdist.strategies.default_strategy")
    return _DEFAULT[0][0]()


def _is_default(strategy: StrategyLike) -> bool:
    return bool(_DEFAULT) and isinstance(strategy, _DEFAULT[0][1])


# Compatibility shims -----------------------------------------------------------


def get_strategy() -> StrategyLike:
    """The strategy in effect: the innermost scope's, else the default strategy."""
    state = STATE.get()
    if state.strategy is not None:
        return state.strategy
    if _SCOPES_BY_THREAD:
        _warn_if_scoped_elsewhere()
    return default_strategy()


def has_strategy() -> bool:
    """True inside a (non-default) strategy's scope or replica function."""
    state = STATE.get()
    return state.strategy is not None and not _is_default(state.strategy)


def in_cross_replica_context() -> bool:
    """True inside a strategy's scope but outside its replica functions (or in a merge_fn)."""
    state = STATE.get()
    return state.strategy is not None and (state.replica is None or state.merging)


def current_replica_context() -> ReplicaContextLike | None:
    """The replica context while a replica function is traced (not in a merge_fn)."""
    state = STATE.get()
    return state.replica if state.replica is not None and not state.merging else None


def experimental_set_strategy(strategy: StrategyLike | None) -> None:
    """Sets (or, with ``None``, clears) the strategy of the current context, outside any scope.

    Raises:
        RuntimeError: inside a ``strategy.scope()`` or a replica function.
    """
    state = STATE.get()
    if state.scope_depth > 0 or state.replica is not None:
        raise RuntimeError(
            "jaxdist.experimental_set_strategy must be called outside any strategy scope and "
            f"replica function; {state.strategy!r} is in effect. Leave the `with "
            "strategy.scope():` block first."
        )
    STATE.set(_State(strategy=strategy))
