"""Where things sit among a train step's arguments: the NNX objects, the
donated state and the rest (`Layout`), and naming an argument in an error."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import jax

from jaxdist._jax_compat import concrete_array_type, is_tracer
from jaxdist.training.step.grouped import Stacked
from jaxdist.training.step.nnx import is_nnx_node
from jaxdist.training.step.state import TrainState
from jaxdist.values.distributed import DistributedValues
from jaxdist.variables import Variable

__all__ = ["NNX", "OTHER", "STATE", "Layout", "argument_label", "is_state_node", "probe"]

NNX, STATE, OTHER = range(3)
_ARRAY: Any = concrete_array_type()


_LEAF_TYPES: dict[type, bool] = {}


def is_state_node(x: Any) -> bool:
    """Leaves of a step's argument tree: state objects, and distributed values and variables
    (left whole for `jaxdist._run.compile.replicated` to map over the replicas).

    Decided once per type (flax's ``isinstance`` checks run Python metaclass code, and
    this is called on every node of every call's arguments), except for tracers, whose
    answer depends on their abstract value.
    """
    t = type(x)
    known = _LEAF_TYPES.get(t)
    if known is None:
        known = isinstance(x, (TrainState, DistributedValues, Variable, Stacked)) or is_nnx_node(x)
        if not is_tracer(x):
            _LEAF_TYPES[t] = known
    return known


class Layout:
    """Where the NNX objects and `TrainState`s sit among one call's arguments."""

    __slots__ = ("_others", "_states", "kinds", "objects", "treedef")

    def __init__(self, leaves: list[Any], treedef: Any, donated: set[int] | None = None) -> None:
        """``donated``: with ``donate_argnums``, the positions of the leaves of the donated
        arguments; these (but NNX objects and distributed values) are the state leaves,
        donated; without, the `TrainState`s are."""
        self.treedef = treedef
        self.kinds = tuple(
            NNX
            if is_nnx_node(x)
            else STATE
            if (
                isinstance(x, TrainState)
                if donated is None
                else i in donated and not isinstance(x, DistributedValues)
            )
            else OTHER
            for i, x in enumerate(leaves)
        )
        # Each a function of the leaves: the NNX objects, the `TrainState`s, the others.
        self.objects, self._states, self._others = (
            _picker(self.kinds, kind) for kind in (NNX, STATE, OTHER)
        )

    def key(self) -> tuple[Any, ...]:
        return (self.treedef, self.kinds)

    def split(self, leaves: list[Any]) -> tuple[list[Any], list[Any]]:
        """(the `TrainState` leaves, the other leaves), in order."""
        return self._states(leaves), self._others(leaves)

    def join(self, objects: tuple[Any, ...], states: list[Any], others: list[Any]) -> list[Any]:
        it_obj, it_state, it_other = iter(objects), iter(states), iter(others)
        out = []
        for k in self.kinds:
            out.append(
                next(it_obj) if k == NNX else next(it_state) if k == STATE else next(it_other)
            )
        return out


def _picker(kinds: tuple[int, ...], kind: int) -> Callable[[list[Any]], list[Any]]:
    """A function returning the leaves of ``kind``, as a list (per call: no Python loop)."""
    positions = [i for i, k in enumerate(kinds) if k == kind]
    if not positions:
        return lambda leaves: []
    if len(positions) == 1:
        (i,) = positions
        return lambda leaves: [leaves[i]]
    get = operator.itemgetter(*positions)
    return lambda leaves: list(get(leaves))


def probe(state: Any) -> Any:
    """The array of ``state`` (a `TrainState`, or an array of an argument named by
    ``donate_argnums``) whose ``is_deleted()`` tells whether it was donated: its step counter
    (no tree walk), else its first concrete array leaf; ``None`` when traced."""
    if type(state) is _ARRAY:
        return state
    step = getattr(state, "step", None)
    if type(step) is _ARRAY:
        return step
    return next((x for x in jax.tree.leaves(state) if type(x) is _ARRAY), None)


def argument_label(
    fn: Callable[..., Any], obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str | None, str]:
    """Where ``obj`` sits among a step's arguments: (the parameter's name when the signature
    gives it, the path: ``args[0]``, ``kwargs['opt']``, or a path into either)."""
    flat, _ = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_state_node)
    path = next((p for p, leaf in flat if leaf is obj), None)
    if path is None or len(path) < 2:
        return None, "?"
    rest = jax.tree_util.keystr(tuple(path[2:]))
    if getattr(path[0], "idx", None) == 1:  # a keyword argument
        name = str(getattr(path[1], "key", "?"))
        return name, f"kwargs[{name!r}]{rest}"
    index = getattr(path[1], "idx", 0)
    return _positional_name(fn, index), f"args[{index}]{rest}"


def _positional_name(fn: Callable[..., Any], index: int) -> str | None:
    """The name of the parameter of ``fn(ctx, *args)`` that ``args[index]`` binds, if any."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]  # after ctx
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, param in enumerate(params):
        if param.kind not in positional:
            return None
        if i == index:
            return param.name
    return None
