"""The leaves of a training state, named as the sharded strategies name them.

`FSDPStrategy` and `MeshStrategy` lay out each leaf of a training state from
its ``/``-joined path (``layers/0/kernel``, ``opt_state/0/mu/layers/0/kernel``,
``params/Dense_0/kernel`` in a `jaxdist.TrainState`) and, for `MeshStrategy`,
from the logical axis names the model gave it: Flax NNX's ``out_sharding``
metadata (``nnx.with_partitioning``), or a Linen ``nn.LogicallyPartitioned``
box around the array in a params tree (optax keeps the box around the
optimizer state it builds from such params). `state_leaves` turns a state
into `StateLeaf` records in the order `jax.tree.leaves` gives its arrays.

flax is never imported here: an NNX object or a Linen box can only exist if
the user imported it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "StateLeaf",
    "as_leaves",
    "box_names",
    "key_str",
    "leaf_bytes",
    "replicated_problem",
    "state_leaves",
    "tree_leaves",
    "variable_names",
]


class StateLeaf(NamedTuple):
    """One array of a training state: its ``/``-joined path, the array (or a
    ``jax.ShapeDtypeStruct``), and its logical axis names (``None``: not annotated)."""

    path: str
    value: Any
    names: tuple[str | None, ...] | None = None


def key_str(key: Any) -> str:
    """One component of a ``/``-joined state path (a JAX key entry or a raw key)."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _as_names(raw: Any) -> tuple[str | None, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, NamedSharding):
        raw = raw.spec
    if isinstance(raw, (P, tuple, list)):
        return tuple(raw)
    return (raw,)


def variable_names(variable: Any) -> tuple[str | None, ...] | None:
    """The logical axis names of an NNX variable (``out_sharding`` metadata; older Flax
    called it ``sharding_names`` or ``sharding``), ``None`` when it has none."""
    meta = variable.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key) is not None:
            return _as_names(meta[key])
    return None


def _linen_box() -> Any:
    spmd = sys.modules.get("flax.linen.spmd")
    return None if spmd is None else getattr(spmd, "LogicallyPartitioned", None)


def box_names(x: Any) -> tuple[str | None, ...] | None:
    """The logical names of a Linen ``LogicallyPartitioned`` box (``None`` for other values)."""
    box = _linen_box()
    if box is None or not isinstance(x, box):
        return None
    return _as_names(x.names)


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def _is_node(x: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, (nnx.Pytree, nnx.Variable))


def tree_leaves(tree: Any, drop: int = 0) -> list[StateLeaf]:
    """Every array of a pytree (NNX variables and Linen boxes in it read with their
    logical names), paths without their first ``drop`` components."""
    nnx = _nnx()
    box = _linen_box()

    def stop(x: Any) -> bool:
        return (box is not None and isinstance(x, box)) or (
            nnx is not None and isinstance(x, nnx.Variable)
        )

    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=stop)[0]:
        keys = [key_str(k) for k in path][drop:]
        names = None
        if nnx is not None and isinstance(leaf, nnx.Variable):
            names, leaf = variable_names(leaf), leaf.get_raw_value()
        elif box is not None and isinstance(leaf, box):
            names, leaf = box_names(leaf), leaf.value
        for sub_path, value in jax.tree_util.tree_flatten_with_path(leaf)[0]:
            sub = [key_str(k) for k in sub_path]
            out.append(StateLeaf("/".join(keys + sub), value, names))
    return out


def state_leaves(state: Any) -> list[StateLeaf]:
    """Every array of ``state`` as a `StateLeaf`.

    ``state``: an NNX object (a Module, an ``nnx.Optimizer``) or its ``nnx.State``,
    a `jaxdist.TrainState`, a pytree of arrays, or a tuple or list of such objects
    (each element one object: paths start inside it, as `jaxdist.train_step` names
    the leaves of its NNX arguments).
    """
    elements = isinstance(state, (tuple, list)) and any(
        _is_node(x) or hasattr(x, "apply_gradients") for x in state
    )
    items = list(state) if elements else [state]
    out: list[StateLeaf] = []
    for item in items:
        if _is_node(item) and not isinstance(item, _nnx().Variable):
            item = _nnx().state(item)
        out.extend(tree_leaves(item))
    return out


def as_leaves(state: Any) -> list[StateLeaf]:
    """``state`` as `StateLeaf` records: a sequence of ``(path, array)`` pairs (the form
    `FSDPStrategy.state_layout` has always taken) as they are, anything else through
    `state_leaves`."""
    if isinstance(state, Sequence) and not isinstance(state, (str, bytes)) and state:
        pairs = all(
            isinstance(x, (tuple, list)) and len(x) in (2, 3) and isinstance(x[0], str)
            for x in state
        )
        if pairs:
            return [StateLeaf(*x) for x in state]
    return state_leaves(state)


def leaf_bytes(value: Any) -> int | None:
    """Bytes of an array-like leaf; ``None`` for a PRNG key array (never sharded)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        value = np.asarray(value)
        dtype = value.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return math.prod(np.shape(value)) * np.dtype(dtype).itemsize


def replicated_problem(
    replicated: Sequence[tuple[int, str, tuple[int, ...]]], total: int, fraction: float | None
) -> str | None:
    """The ``max_replicated_fraction`` guard: a problem naming the five largest of the
    ``(bytes, path, shape)`` replicated leaves when they hold more than ``fraction`` of
    the state's ``total`` bytes; ``None`` when within it (or no guard)."""
    rep_bytes = sum(s for s, _, _ in replicated)
    if fraction is None or not total or rep_bytes <= fraction * total:
        return None
    largest = sorted(replicated, key=lambda r: -r[0])[:5]
    listed = "; ".join(f"{p} {s} ({b:,} bytes)" for b, p, s in largest)
    return (
        f"{rep_bytes:,} of the state's {total:,} bytes ({rep_bytes / total:.1%}) stay "
        f"replicated, more than max_replicated_fraction={fraction}. The largest replicated "
        f"leaves: {listed}. Shard them with a rule, lower min_shard_bytes, or raise "
        "max_replicated_fraction"
    )
