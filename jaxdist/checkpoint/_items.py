"""What a `Checkpoint` can hold, and how each kind is saved and put back.

Three kinds of items:

- ``"nnx"``: a Flax NNX graph node (a module, an optimizer, ``nnx.Rngs``).
  Saved as its ``nnx.state``; restored *in place* with ``nnx.update``, so
  every reference to the object sees the restored values.
- ``"iterator"``: an object with ``get_state()`` / ``set_state(state)``
  (a jaxdist `DistributedIterator`, a grain iterator). Its state is a small
  JSON-able value, saved by each process for itself; restored in place.
- ``"pytree"``: anything else (arrays, `jaxdist.Variable`s, distributed
  values, a `TrainState`, dicts and tuples of them). Functional: restoring
  gives a new value, which the checkpoint holds from then on.

NNX objects nested inside a pytree item are treated as pytrees (rebuilt, not
updated in place); give them their own item to restore them in place. flax is
imported lazily: jaxdist does not depend on it.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["ITERATOR", "KINDS", "NNX", "PYTREE", "kind_of", "put_back", "tree_of"]

NNX = "nnx"
ITERATOR = "iterator"
PYTREE = "pytree"
KINDS = (NNX, ITERATOR, PYTREE)


def _nnx() -> Any | None:
    """``flax.nnx`` if the user imported it (NNX objects cannot exist otherwise)."""
    return sys.modules.get("flax.nnx")


def _is_nnx_node(x: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.Pytree)


def _is_iterator(x: Any) -> bool:
    return callable(getattr(x, "get_state", None)) and callable(getattr(x, "set_state", None))


def kind_of(item: Any) -> str:
    """The item's kind: `NNX`, `ITERATOR` or `PYTREE`."""
    if _is_nnx_node(item):
        return NNX
    if _is_iterator(item):
        return ITERATOR
    return PYTREE


def tree_of(item: Any, kind: str) -> Any:
    """The pytree of arrays that stands for a `NNX` or `PYTREE` item."""
    if kind == NNX:
        nnx = _nnx()
        assert nnx is not None
        return nnx.state(item)
    return item


def put_back(item: Any, kind: str, restored: Any) -> Any:
    """Puts a restored tree back: an NNX object is updated in place and returned; a pytree
    item's restored value is returned (it replaces the item)."""
    if kind == NNX:
        nnx = _nnx()
        assert nnx is not None
        nnx.update(item, restored)
        return item
    return restored
