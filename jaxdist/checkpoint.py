"""Saving and restoring strategy-placed state, with tf.distribute's variable semantics.

`to_saveable` turns a state pytree into plain host arrays: a mirrored
variable saves its value, an ``ON_READ`` variable its aggregate (the sum of
its copies for ``SUM``). `from_saveable` puts saved arrays back into a
*template* created under any strategy (any replica count): each variable is
set with cross-replica ``assign``, so restoring an ``ON_READ`` ``SUM``
variable divides the saved total by the new replica count and ``MEAN`` ones
restore as they are. `save` / `restore` write and read a directory with
orbax-checkpoint (``pip install jaxdist[checkpoint]``).

Example:
    >>> import jax.numpy as jnp, jaxdist as jd
    >>> v = jd.Variable(jnp.arange(3.0))
    >>> saved = jd.checkpoint.to_saveable({"v": v})
    >>> restored = jd.checkpoint.from_saveable(saved, {"v": v.assign(jnp.zeros(3))})
    >>> [float(x) for x in restored["v"].read_value()]
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jaxdist.values import DistributedValues
from jaxdist.variables import Variable, VariableAggregation

__all__ = ["from_saveable", "restore", "save", "to_saveable"]


def _is_node(x: Any) -> bool:
    return isinstance(x, (Variable, DistributedValues))


def _saved_value(x: Any) -> Any:
    if isinstance(x, Variable):
        if x.is_on_read and x.aggregation is VariableAggregation.NONE:
            return np.asarray(x.device_values[0])  # no aggregate: replica 0's copy, as TF saves
        return np.asarray(x.read_value())
    if isinstance(x, DistributedValues):
        return np.asarray(x.array)
    return np.asarray(x)


def to_saveable(state: Any) -> Any:
    """The pytree ``state`` with every leaf as a host NumPy array, variables aggregated."""
    return jax.tree.map(_saved_value, state, is_leaf=_is_node)


def from_saveable(saved: Any, template: Any) -> Any:
    """Puts ``saved`` (from `to_saveable`) into the placement of ``template``.

    ``template`` has the structure of the saved state; its variables (created
    in the target strategy's scope) give synchronization, aggregation and
    placement. Other leaves are placed like the template's leaf.
    """
    saved_leaves = jax.tree.leaves(saved)
    t_leaves, t_def = jax.tree.flatten(template, is_leaf=_is_node)
    if len(saved_leaves) != len(t_leaves):
        raise ValueError(
            f"jaxdist.checkpoint.from_saveable: the saved state has {len(saved_leaves)} "
            f"leaves but the template has {len(t_leaves)}; build the template with the same "
            "structure as the state that was saved."
        )
    out: list[Any] = []
    for s, t in zip(saved_leaves, t_leaves, strict=True):
        if isinstance(t, Variable):
            out.append(t.assign(s))
        elif isinstance(t, DistributedValues):
            out.append(type(t)(jax.device_put(np.asarray(s), t.array.sharding)))
        elif isinstance(t, jax.Array):
            out.append(jax.device_put(np.asarray(s, dtype=t.dtype), t.sharding))
        else:
            out.append(s)
    return jax.tree.unflatten(t_def, out)


def _checkpointer() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "jaxdist.checkpoint.save/restore need orbax-checkpoint: "
            "pip install 'jaxdist[checkpoint]' (or use to_saveable/from_saveable with your "
            "own storage)."
        ) from e
    return ocp.StandardCheckpointer()


def save(directory: str | os.PathLike[str], state: Any) -> None:
    """Writes `to_saveable(state)` to a new ``directory`` with orbax-checkpoint."""
    ckpt = _checkpointer()
    ckpt.save(os.path.abspath(directory), to_saveable(state))
    ckpt.wait_until_finished()
    ckpt.close()


def restore(directory: str | os.PathLike[str], template: Any) -> Any:
    """Reads ``directory`` (written by `save`) into the placement of ``template``."""
    ckpt = _checkpointer()
    saved = ckpt.restore(os.path.abspath(directory), to_saveable(template))
    ckpt.close()
    return from_saveable(saved, template)
