"""Flax NNX objects as train-step state, without a graph walk per call.

`nnx.split` / `nnx.state` / `nnx.update` each cost about a third of a
millisecond of Python for a small model and its optimizer, more than a whole
GPU step of a small model. So a `StateCache` walks the objects' graph once
(`nnx.split`) and keeps:

- the `GraphDef` (static: the step is compiled for it),
- the `nnx.Variable` objects themselves, in state order, whose raw values are
  read and written directly on every later call,
- a snapshot of every graph node's attribute dict (a shallow copy). A call
  compares the live dicts with it in one C-level ``==`` per node: an
  attribute that is still the same object compares by identity at no cost,
  so a step whose structure holds pays one pass over the attributes and no
  Python per attribute. Replacing a submodule (NNX nodes compare by
  identity) or a `Variable` of more than one element (comparing two such
  variables raises, taken as a change), adding or removing an attribute, or
  flipping a static flag (``model.eval()``) is seen; so is replacing a
  variable of one element (the one case where two different variables can
  compare equal), through an identity check of those few attributes.
  Updating a variable's value changes nothing. A changed structure falls
  back to a new walk (and a new program when the `GraphDef` differs).

Values are read and written through the ``_raw_value`` slot descriptor of
``nnx.Variable`` mapped over the variables (one C-level pass each way), as
`nnx.update` would set them, without its walk.

This is the design Flax's own ``nnx.cached_partial`` takes (walk once, keep
the `Variable` objects, set their values after each call), plus the change
check that ``cached_partial`` leaves out: it documents that the structure
must not change, while a train step here notices and recompiles.

flax is imported lazily: jaxdist does not depend on it.
"""

from __future__ import annotations

import collections
import operator
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["StateCache", "is_nnx_node", "nnx_module"]


def nnx_module() -> Any | None:
    """``flax.nnx`` if the user imported it (NNX objects cannot exist otherwise)."""
    return sys.modules.get("flax.nnx")


def is_nnx_node(x: Any) -> bool:
    """True for NNX graph nodes (modules, optimizers, ``Rngs``) and NNX variables."""
    nnx = nnx_module()
    return nnx is not None and isinstance(x, (nnx.Pytree, nnx.Variable))


def _path_str(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


_drain: Any = collections.deque(maxlen=0).extend  # runs an iterator to its end, in C
_raw_value = operator.attrgetter("_raw_value")


def _slot_setter(variables: Sequence[Any]) -> Any:
    """``set(variable, value)`` for all of ``variables``: the ``_raw_value`` slot
    descriptor's ``__set__`` when they share it (a third of the cost of
    ``object.__setattr__``, which looks the name up on every call), else that."""
    slots = {_owner_slot(type(v)) for v in variables}
    if len(slots) == 1:
        (slot,) = slots
        if type(slot).__name__ == "member_descriptor":
            return slot.__set__
    return lambda v, value: object.__setattr__(v, "_raw_value", value)


def _owner_slot(cls: type) -> Any:
    """What the class attribute ``_raw_value`` resolves to on ``cls`` (its slot)."""
    for c in cls.__mro__:
        if "_raw_value" in vars(c):
            return vars(c)["_raw_value"]
    return None


class StateCache:
    """One traversal of a tuple of NNX objects, reused while their structure holds."""

    __slots__ = (
        "graphdef",
        "is_key",
        "nodes",
        "objects",
        "paths",
        "pinned",
        "probes",
        "set_value",
        "snapshots",
        "state_treedef",
        "variables",
    )

    def __init__(self, objects: tuple[Any, ...], where: str) -> None:
        nnx = nnx_module()
        assert nnx is not None
        self.objects = objects
        graphdef, state = nnx.split(objects)
        self.graphdef = graphdef
        self.state_treedef = jax.tree.structure(state)
        flat = nnx.to_flat_state(state)
        self.paths = [_path_str(p) for p in flat.paths]
        # (object index, index of its first variable), one per object with variables: the
        # one value a donating step checks per object for deleted buffers.
        firsts: dict[int, int] = {}
        for i, path in enumerate(flat.paths):
            firsts.setdefault(path[0], i)
        self.probes = sorted(firsts.items())
        self.variables = list(flat.leaves)
        for path, var in zip(self.paths, self.variables, strict=True):
            value = var.get_raw_value()
            if not isinstance(value, (jax.Array, np.ndarray)):
                raise TypeError(
                    f"{where}: NNX variable {path} ({type(var).__name__}) holds a "
                    f"{type(value).__name__}, not an array; a train step carries NNX state "
                    "as arrays. Store arrays in nnx.Variable objects (or keep this value as a "
                    "static attribute)."
                )
        self.is_key = [isinstance(v, nnx.RngKey) for v in self.variables]
        self.set_value = _slot_setter(self.variables)
        self.nodes = [
            node
            for _, node in nnx.iter_graph(objects)
            if isinstance(node, nnx.Pytree) and hasattr(node, "__dict__")
        ]
        self.snapshots = [dict(vars(node)) for node in self.nodes]
        # Attributes holding a variable of at most one element: two such variables may
        # compare equal by value, so `unchanged` checks these by identity.
        self.pinned = [
            (attrs, name, value)
            for attrs in map(vars, self.nodes)
            for name, value in attrs.items()
            if isinstance(value, nnx.Variable) and np.size(value.get_raw_value()) <= 1
        ]

    def unchanged(self, objects: Sequence[Any]) -> bool:
        """True when ``objects`` are the cached ones with the same graph structure."""
        if len(objects) != len(self.objects) or not all(map(operator.is_, objects, self.objects)):
            return False
        try:
            if list(map(vars, self.nodes)) != self.snapshots:
                return False
        except Exception:  # a replaced variable's `==` raised: the structure changed
            return False
        return all(attrs.get(name) is value for attrs, name, value in self.pinned)

    def read(self) -> list[Any]:
        """The variables' current values (no copies)."""
        return list(map(_raw_value, self.variables))

    def write(self, values: Sequence[Any]) -> None:
        """Sets the variables' values in place, as `nnx.update` would (without its walk).

        Called outside any trace, so NNX's trace-level check has nothing to guard.
        """
        if len(values) != len(self.variables):
            raise ValueError(
                f"jaxdist: {len(values)} values for {len(self.variables)} NNX variables."
            )
        _drain(map(self.set_value, self.variables, values))

    def rebuild(self, values: Sequence[Any]) -> tuple[Any, ...]:
        """New NNX objects (inside a trace) holding ``values``, with this structure."""
        nnx = nnx_module()
        assert nnx is not None
        state = jax.tree.unflatten(self.state_treedef, list(values))
        return nnx.merge(self.graphdef, state)

    def extract(self, objects: Any, where: str) -> list[Any]:
        """The values of ``objects`` (rebuilt by `rebuild`) after the step, in state order."""
        nnx = nnx_module()
        assert nnx is not None
        graphdef, state = nnx.split(objects)
        if graphdef != self.graphdef:
            raise ValueError(
                f"{where}: the structure of the NNX objects changed inside the step (an "
                "attribute, submodule or variable was added, removed or replaced, for example "
                "by Module.sow). A train step may change variable values only: create the "
                "structure before the first step, or remove temporary variables with nnx.pop "
                "before the step returns."
            )
        return list(jax.tree.leaves(state))
