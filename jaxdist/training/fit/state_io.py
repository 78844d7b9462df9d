"""Training state as host arrays and back: the NNX objects and functional states
of a `jaxdist.fit` run named by path, copied to NumPy for a checkpoint, and placed back
like the live state on restore."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxdist import _cpu_gate
from jaxdist.checkpoint import from_saveable, to_saveable
from jaxdist.checkpoint._arrays import is_saved_node, path_tokens
from jaxdist.training.step.nnx import is_nnx_node, nnx_module


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def host_array(x: Any) -> np.ndarray:
    """``x`` as a NumPy array; an array split across processes is all-gathered first."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(_cpu_gate.gated(lambda: multihost_utils.process_allgather(x, tiled=True)))
    return np.asarray(x)


def _tree_of(arg: Any) -> Any:
    if is_nnx_node(arg):
        nnx = nnx_module()
        assert nnx is not None
        return nnx.state(arg)
    return arg


def _named_leaves(state: tuple[Any, ...]) -> list[tuple[tuple[str, ...], Any]]:
    """Every array of the state arguments with its name path (``("0", "conv", "kernel")``)."""
    out = []
    for i, arg in enumerate(state):
        nnx_arg = is_nnx_node(arg)
        flat = jax.tree_util.tree_flatten_with_path(_tree_of(arg), is_leaf=is_saved_node)[0]
        for path, leaf in flat:
            names = list(path_tokens(path))
            if nnx_arg and names and names[-1] == "value":  # an nnx.Variable's payload
                names.pop()
            out.append(((str(i), *names), leaf))
    return out


def _host_leaf(leaf: Any) -> np.ndarray:
    if is_saved_node(leaf):
        return np.asarray(to_saveable(leaf))
    if _is_key(leaf):
        return host_array(jax.random.key_data(leaf))
    return host_array(leaf)


def host_state(state: tuple[Any, ...]) -> dict[str, Any]:
    """A nested dict of host NumPy copies of the state arguments' arrays (private helper)."""
    tree: dict[str, Any] = {}
    for names, leaf in _named_leaves(state):
        node = tree
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = _host_leaf(leaf)
    return tree


def _lookup(tree: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    node: Any = tree
    for name in names:
        if not isinstance(node, Mapping) or name not in node:
            return None
        node = node[name]
    return node


def _placed(saved: np.ndarray, template: Any, where: str, name: str) -> Any:
    """A saved host array put where ``template`` lives, with its dtype."""
    if is_saved_node(template):
        return from_saveable(saved, template)
    if _is_key(template):
        data = jax.random.key_data(template)
        if saved.shape != data.shape:
            raise ValueError(
                f"{where}: the saved random key {name} has key data of shape {saved.shape}, "
                f"but the state's key has {data.shape}."
            )
        return jax.random.wrap_key_data(_put(saved, template), impl=jax.random.key_impl(template))
    shape = tuple(np.shape(template))
    if tuple(saved.shape) != shape:
        raise ValueError(
            f"{where}: the saved array {name} has shape {tuple(saved.shape)}, but the state's "
            f"has {shape}. Restore into a state built like the one that was saved (same "
            "model, optimizer and sizes)."
        )
    if isinstance(template, jax.Array):
        return _put(np.asarray(saved, dtype=template.dtype), template)
    return np.asarray(saved, dtype=np.asarray(template).dtype)


def _put(saved: np.ndarray, template: Any) -> jax.Array:
    """``saved`` on the template's devices; uncommitted like the template when it is (so a
    train step can still place it on its strategy's devices)."""
    if template.committed:
        return jax.device_put(saved, template.sharding)
    return jax.device_put(saved)


def load_state(saved: Mapping[str, Any], state: tuple[Any, ...], where: str) -> tuple[Any, ...]:
    """Puts a `host_state` tree back: NNX objects updated in place, functional states
    rebuilt; returns the state arguments with the functional ones replaced (private)."""
    named = _named_leaves(state)
    missing = [".".join(n) for n, _ in named if _lookup(saved, n) is None]
    if missing:
        raise ValueError(
            f"{where}: the checkpoint has no array for {missing[:3]}"
            f"{' and more' if len(missing) > 3 else ''} of the state given to restore into; "
            f"it holds {sorted(saved)} at the top (one entry per state argument). Pass the "
            "same state arguments, in the same order, as were given to fit."
        )
    values = iter(
        _placed(np.asarray(_lookup(saved, n)), leaf, where, ".".join(n)) for n, leaf in named
    )
    out = []
    for arg in state:
        tree = _tree_of(arg)
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_saved_node)
        new = jax.tree.unflatten(treedef, [next(values) for _ in leaves])
        if is_nnx_node(arg):
            nnx = nnx_module()
            assert nnx is not None
            nnx.update(arg, new)
            out.append(arg)
        else:
            out.append(new)
    return tuple(out)
