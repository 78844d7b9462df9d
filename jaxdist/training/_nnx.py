"""Flax NNX objects as train-step state, without a graph walk per call (private).

`nnx.split` / `nnx.state` / `nnx.update` each cost about a third of a
millisecond of Python for a small model and its optimizer, more than a whole
GPU step of a small model. So a `StateCache` walks the objects' graph once
(`nnx.split`) and keeps:

- the `GraphDef` (static: the step is compiled for it),
- the `nnx.Variable` objects themselves, in state order, whose raw values are
  read and written directly on every later call,
- a fingerprint of every graph node: its attribute dict and the identity of
  each attribute value. Replacing a submodule or a `Variable`, adding an
  attribute or flipping a static flag (``model.eval()``) changes it; updating
  a variable's value does not. `unchanged` compares it in a few microseconds,
  and a changed structure falls back to a new walk (and a new program when
  the `GraphDef` differs).

flax is imported lazily: jaxdist does not depend on it.
"""

from __future__ import annotations

import collections
import itertools
import operator
import sys
from collections.abc import Sequence
from itertools import chain
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


_setattr = object.__setattr__
_RAW_VALUE = itertools.repeat("_raw_value")
_drain: Any = collections.deque(maxlen=0).extend  # runs an iterator to its end, in C
_dict_values: Any = dict.values


class StateCache:
    """One traversal of a tuple of NNX objects, reused while their structure holds."""

    __slots__ = (
        "graphdef",
        "is_key",
        "nodes",
        "objects",
        "paths",
        "probes",
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
        self.nodes = [
            node
            for _, node in nnx.iter_graph(objects)
            if isinstance(node, nnx.Pytree) and hasattr(node, "__dict__")
        ]
        self.snapshots = self._fingerprint()

    def _fingerprint(self) -> tuple[list[int], list[Any]]:
        """Each node's attribute count, and every attribute value, in order."""
        dicts = list(map(vars, self.nodes))
        return list(map(len, dicts)), list(chain.from_iterable(map(_dict_values, dicts)))

    def unchanged(self, objects: Sequence[Any]) -> bool:
        """True when ``objects`` are the cached ones with the same graph structure."""
        if len(objects) != len(self.objects) or not all(map(operator.is_, objects, self.objects)):
            return False
        lengths, values = self.snapshots
        dicts = list(map(vars, self.nodes))
        if list(map(len, dicts)) != lengths:
            return False
        return all(map(operator.is_, chain.from_iterable(map(_dict_values, dicts)), values))

    def read(self) -> list[Any]:
        """The variables' current values (no copies)."""
        return [v._raw_value for v in self.variables]

    def write(self, values: Sequence[Any]) -> None:
        """Sets the variables' values in place, as `nnx.update` would (without its walk).

        Called outside any trace, so NNX's trace-level check has nothing to guard.
        """
        if len(values) != len(self.variables):
            raise ValueError(
                f"jaxdist: {len(values)} values for {len(self.variables)} NNX variables."
            )
        _drain(map(_setattr, self.variables, _RAW_VALUE, values))

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
