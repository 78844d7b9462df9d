"""Creating training state directly in slices over a strategy's devices.

`FSDPStrategy.experimental_create` runs an initializer (a function building NNX
objects, a `TrainState`, or a pytree of arrays) without the whole state ever
existing on one device:

1. ``fn`` is traced abstractly (``nnx.eval_shape``, ``jax.eval_shape`` without
   Flax): only shapes and dtypes, no memory;
2. every leaf is laid out by the strategy's rules from its ``/``-joined path
   and its logical axis names (`Strategy.state_specs`: the same decision, and
   errors, as the train step's);
3. ``fn`` runs inside ``jax.jit`` with ``out_shardings`` of those layouts, so
   XLA's partitioner computes each device's slice on that device (random
   initializers included: JAX's threefry keys give the same numbers however
   the result is sharded);
4. the NNX objects are rebuilt around the sharded arrays (``nnx.merge``).

Paths are those `jaxdist.train_step` uses: the path inside each returned
object (``layers/0/kernel``, ``opt_state/0/mu/layers/0/kernel``) or inside a
returned `TrainState` (``params/Dense_0/kernel``); when ``fn`` returns a tuple
or list, each of its elements is one object.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxdist._run.compile import path_str
from jaxdist.strategies._state_leaves import StateLeaf, tree_leaves
from jaxdist.strategies.base import Strategy

__all__ = ["create_sharded", "sharded_initializer"]


def _nnx() -> Any:
    """``flax.nnx``, or ``None`` when not loaded (NNX objects cannot exist then)."""
    return sys.modules.get("flax.nnx")


def _abstract(fn: Callable[..., Any], args: Any, kwargs: Any, where: str) -> Any:
    nnx = _nnx()
    trace = jax.eval_shape if nnx is None else nnx.eval_shape
    try:
        return trace(lambda: fn(*args, **kwargs))
    except TypeError as err:
        if "valid JAX type" not in str(err):
            raise
        raise TypeError(
            f"{where}: fn must return NNX objects (a Module, a tuple such as (model, "
            "nnx.Optimizer(model, tx, wrt=nnx.Param))), a jaxdist.TrainState or a pytree "
            f"of arrays; {getattr(fn, '__name__', fn)!r} returned a non-array leaf: {err}"
        ) from None


def _has_nodes(tree: Any) -> bool:
    nnx = _nnx()
    if nnx is None:
        return False
    kinds = (nnx.Pytree, nnx.Variable)
    return any(
        isinstance(x, kinds) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kinds))
    )


def _check_no_nodes(args: tuple[Any, ...], kwargs: dict[str, Any], where: str) -> None:
    nnx = _nnx()
    if nnx is None:
        return
    kinds = (nnx.Pytree, nnx.Variable)
    flat = jax.tree_util.tree_flatten_with_path(
        (args, kwargs), is_leaf=lambda x: isinstance(x, kinds)
    )[0]
    nodes = [f"{path_str(p)} ({type(x).__name__})" for p, x in flat if isinstance(x, kinds)]
    if nodes:
        raise TypeError(
            f"{where}: NNX objects cannot be arguments of fn: {', '.join(nodes)}; fn runs "
            "inside jax.jit, where it could not update them. Create them inside fn, e.g. "
            "strategy.experimental_create(lambda seed: MyModel(nnx.Rngs(seed)), 0)."
        )


def _split(tree: Any) -> tuple[Any, Any]:
    """(NNX graphdef, state) of ``fn``'s output; ``(None, tree)`` when it holds no NNX
    object (a `TrainState`, a pytree of arrays)."""
    if not _has_nodes(tree):
        return None, tree
    return _nnx().split(tree)


def _leaves(state: Any, per_element: bool, where: str) -> list[StateLeaf]:
    """Every leaf of ``state`` with its ``/``-joined path (without the element index
    when ``fn`` returned a tuple of objects), abstract array and logical names."""
    leaves = tree_leaves(state, drop=1 if per_element else 0)
    bad = [
        f"{leaf.path or '<output>'}: {type(leaf.value).__name__}"
        for leaf in leaves
        if not isinstance(leaf.value, jax.ShapeDtypeStruct)
    ]
    if bad:
        raise TypeError(
            f"{where}: fn must return NNX objects, a jaxdist.TrainState or a pytree of "
            f"arrays; these leaves are not arrays: {'; '.join(bad)}. Keep such values as "
            "static attributes of a Module, or build them outside fn."
        )
    if not leaves:
        raise ValueError(
            f"{where}: fn returned no arrays ({jax.tree.structure(state)}); it must build "
            "the model, optimizer or TrainState to create sharded."
        )
    return leaves


def sharded_initializer(
    strategy: Strategy,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: str,
) -> tuple[Any, Callable[[list[Any]], Any]]:
    """The jitted initializer (no arguments; returns the state's arrays, each laid out
    by the strategy's rules, `Strategy.state_specs`, over ``strategy.mesh``) and the
    function that rebuilds ``fn``'s result (NNX objects, `TrainState`, ...) around
    those arrays."""
    nnx = _nnx()
    built = nnx is not None and isinstance(fn, (nnx.Pytree, nnx.Variable))
    if not callable(fn) or built:
        raise TypeError(
            f"{where}: fn must be a callable that builds the state, got "
            f"{'an already built ' if built else ''}{type(fn).__name__} object. Pass "
            "the function that builds it, so it is never whole on one device: "
            "strategy.experimental_create(lambda: MyModel(nnx.Rngs(0)))."
        )
    _check_no_nodes(args, kwargs, where)
    abstract = _abstract(fn, args, kwargs, where)
    graphdef, state = _split(abstract)
    leaves = _leaves(state, isinstance(abstract, (tuple, list)), where)
    specs = strategy.state_specs(leaves, where)
    if specs is None:
        raise TypeError(f"{where}: {strategy!r} keeps training state replicated")
    shardings = [NamedSharding(strategy.mesh, spec) for spec in specs]

    # The initializer returns the flat list of arrays: static parts of the state (an
    # optax transformation built inside fn, say) differ between calls, so the result is
    # rebuilt around the abstract trace's structure.
    full = jax.tree.structure(state)
    if len(jax.tree.leaves(state)) != len(shardings):  # a Variable holds one array
        raise AssertionError(f"{where}: the state's arrays do not match its leaves")

    def build() -> list[Any]:
        out = fn(*args, **kwargs)
        return jax.tree.leaves(out if graphdef is None else _nnx().split(out)[1])

    init = jax.jit(build, out_shardings=shardings)
    return init, lambda values: _rebuild(graphdef, full, values)


def _rebuild(graphdef: Any, treedef: Any, values: list[Any]) -> Any:
    state = jax.tree.unflatten(treedef, values)
    return state if graphdef is None else _nnx().merge(graphdef, state)


def create_sharded(
    strategy: Strategy,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: str,
) -> Any:
    """``fn(*args, **kwargs)`` computed with each leaf in slices over the devices, as
    `sharded_initializer` lays it out: never whole on one device."""
    init, rebuild = sharded_initializer(strategy, fn, args, kwargs, where)
    return rebuild(init())
