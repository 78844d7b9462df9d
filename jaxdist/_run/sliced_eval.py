"""Evaluating a replica function's jaxpr when some outputs are wanted as one slice.

Sharded training state (`jaxdist.experimental.FSDPStrategy`) leaves a step as
each device's block of an output that is the same on every replica: the
updated parameters and optimizer state. Computing the whole output on every
device and then slicing it repeats the optimizer's work ``n`` times and keeps a
gathered copy of the optimizer state alive. `eval_sliced` instead pushes the
slice up the jaxpr (nested ``jit`` equations evaluated in line first),
through element-wise equations, as XLA's partitioner would for a global-view
program:

- an element-wise equation whose result is only needed sliced (along one
  dimension) runs on the slices of its operands (scalar operands whole);
- the slice of an ``all_gather`` (tiled, over the replica axis, along that
  dimension) is the gathered operand itself: the device's own block, so the
  optimizer state is never gathered;
- the slice of a ``psum`` over the replica axis (the all-reduced gradients)
  that is needed whole nowhere is a ``psum_scatter`` (a reduce-scatter: half
  the traffic of the all-reduce);
- any other value is computed whole and sliced with ``dynamic_slice`` at the
  replica's index.

The values computed are those of slicing the whole results (element-wise
operations commute with slicing; a reduce-scatter adds the same terms as the
all-reduce, possibly in another order), so the step's results do not change
beyond float rounding; only the work, the traffic and the memory do. Equations are evaluated in
order; one whose results are needed sliced only is evaluated whole only if a
slice of it cannot be had otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax import lax

from jaxdist._jax_compat import axis_names, is_literal, primitive_name, varies

__all__ = ["eval_sliced", "local_slice"]

# Element-wise primitives: every operand has the result's shape or is a scalar.
ELEMENTWISE = frozenset(
    {
        "abs", "add", "and", "atan2", "ceil", "clamp", "convert_element_type", "copy",
        "copy_p", "cos", "div", "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt",
        "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min",
        "mul", "ne", "neg", "nextafter", "not", "or", "pow", "rem", "round", "rsqrt",
        "select_n", "sign", "sin", "sqrt", "square", "sub", "tan", "tanh", "xor",
    }
)  # fmt: skip
# Nested jits, evaluated in line first.
JITS = frozenset({"jit", "pjit"})
# Sums over replicas: a slice of one is a reduce-scatter.
SUMS = frozenset({"psum", "psum_invariant"})
# Casts of the varying-axes type: the identity on values.
CASTS = frozenset({"pvary", "pcast"})


def local_slice(x: Any, axis: str | tuple[str, ...], dim: int, n: int) -> Any:
    """This replica's block ``axis_index`` of ``n`` along ``dim`` of ``x``."""
    size = x.shape[dim] // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * size, size, axis=dim)


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _sliceable(eqn: Any, out_shape: tuple[int, ...]) -> bool:
    name = primitive_name(eqn)
    if name == "broadcast_in_dim":
        return not _shape(eqn.invars[0])
    if name not in ELEMENTWISE and name not in CASTS:
        return False
    return all(_shape(a) in (out_shape, ()) for a in eqn.invars)


def _inlined(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluates ``jaxpr`` with the bodies of nested ``jit`` equations evaluated in line
    (traced, this gives one flat jaxpr: optax and flax jit some of their helpers)."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(a: Any) -> Any:
        return a.val if is_literal(a) else env[a]

    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        inner = eqn.params.get("jaxpr") if primitive_name(eqn) in JITS else None
        if inner is not None and hasattr(inner, "consts"):
            outs = _inlined(inner.jaxpr, inner.consts, *invals)
        else:
            outs = _bind(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(a) for a in jaxpr.outvars]


def _pure(eqn: Any) -> bool:
    """No effect but naming mesh axes (as collectives do): may be run late, or never."""
    return all(type(e).__name__ == "NamedAxisEffect" for e in eqn.effects)


def _bind(eqn: Any, args: list[Any]) -> Any:
    """``eqn``'s primitive applied to ``args`` (as ``jax.core.eval_jaxpr`` does)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
        return eqn.primitive.bind(*subfuns, *args, **params)
    return eqn.primitive.bind(*args, **params)


def _demand(
    jaxpr: Any, sliced_outs: dict[int, int]
) -> tuple[set[Any], dict[Any, set[int]], dict[int, int]]:
    """(vars needed whole, vars needed sliced -> dims, equation index -> dim it runs
    sliced along), by a walk from the outputs back."""
    whole: set[Any] = set()
    sliced: dict[Any, set[int]] = {}
    eqn_dims: dict[int, int] = {}
    for i, v in enumerate(jaxpr.outvars):
        if is_literal(v):
            continue
        if i in sliced_outs:
            sliced.setdefault(v, set()).add(sliced_outs[i])
        else:
            whole.add(v)
    for index in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[index]
        outs = eqn.outvars
        dims = sliced.get(outs[0]) if len(outs) == 1 else None
        if (
            dims is not None
            and len(dims) == 1
            and outs[0] not in whole
            and not eqn.effects
            and _sliceable(eqn, _shape(outs[0]))
        ):
            (d,) = dims
            eqn_dims[index] = d
            shape = _shape(outs[0])
            for a in eqn.invars:
                if is_literal(a):
                    continue
                if _shape(a) == shape:
                    sliced.setdefault(a, set()).add(d)
                else:
                    whole.add(a)
            continue
        whole.update(a for a in eqn.invars if not is_literal(a))
    return whole, sliced, eqn_dims


def eval_sliced(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    sliced_outs: dict[int, int],
    axis: str | tuple[str, ...],
    n: int,
) -> list[Any]:
    """Evaluates ``jaxpr`` (inside ``shard_map``, manual over ``axis`` of size ``n``);
    output ``i`` in ``sliced_outs`` comes back as this replica's block along dimension
    ``sliced_outs[i]``, the others whole."""
    if any(primitive_name(e) in JITS for e in jaxpr.eqns):
        closed = jax.make_jaxpr(functools.partial(_inlined, jaxpr, consts))(*args)
        jaxpr, consts = closed.jaxpr, closed.consts
    whole, _, eqn_dims = _demand(jaxpr, sliced_outs)
    names = set(axis_names(axis))
    env: dict[Any, Any] = {}
    senv: dict[tuple[Any, int], Any] = {}
    producer: dict[Any, int] = {}
    deferred: set[int] = set()

    def read(a: Any) -> Any:
        if is_literal(a):
            return a.val
        if a not in env:
            run(producer[a])  # deferred: needed whole after all
        return env[a]

    def varying(x: Any) -> Any:
        x = jax.numpy.asarray(x)
        return x if varies(x, axis) else lax.pcast(x, axis, to="varying")

    def read_sliced(a: Any, d: int) -> Any:
        if is_literal(a):
            return a.val
        key = (a, d)
        if key in senv:
            return senv[key]
        index = producer.get(a)
        eqn = None if index is None else jaxpr.eqns[index]
        if (
            eqn is not None
            and primitive_name(eqn) == "all_gather"
            and eqn.params.get("tiled")
            and eqn.params.get("all_gather_dimension") == d
            and set(axis_names(eqn.params.get("axis_name"))) == names
            and eqn.params.get("axis_index_groups") is None
        ):
            value = read(eqn.invars[0])  # the device's own block
        elif (
            eqn is not None
            and primitive_name(eqn) in SUMS
            and set(axis_names(eqn.params.get("axes", ()))) == names
            and eqn.params.get("axis_index_groups") is None
            and a not in env
        ):  # a sum over the replicas of which each keeps a slice: a reduce-scatter
            operand = read(eqn.invars[eqn.outvars.index(a)])
            value = lax.psum_scatter(operand, axis, scatter_dimension=d, tiled=True)
        elif index is not None and index in eqn_dims:
            run_sliced(index)
            value = senv[key]
        else:
            value = local_slice(read(a), axis, d, n)
        senv[key] = value
        return value

    def run(index: int) -> None:
        eqn = jaxpr.eqns[index]
        deferred.discard(index)
        outs = _bind(eqn, list(map(read, eqn.invars)))
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))

    def run_sliced(index: int) -> None:
        eqn = jaxpr.eqns[index]
        d = eqn_dims[index]
        out = eqn.outvars[0]
        shape = _shape(out)
        name = primitive_name(eqn)
        if name == "broadcast_in_dim":
            block = (*shape[:d], shape[d] // n, *shape[d + 1 :])
            value = varying(lax.broadcast_in_dim(read(eqn.invars[0]), block, ()))
        elif name in CASTS:
            value = read_sliced(eqn.invars[0], d)
        else:
            ops = [
                varying(
                    jax.numpy.asarray(a.val, a.aval.dtype)
                    if is_literal(a)
                    else read_sliced(a, d)
                    if _shape(a) == shape
                    else read(a)
                )
                for a in eqn.invars
            ]
            value = _bind(eqn, ops)
        senv[(out, d)] = value

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for index, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            producer[v] = index
        if index in eqn_dims:
            continue  # run when its slice is read
        if _pure(eqn) and not any(v in whole for v in eqn.outvars):
            deferred.add(index)  # needed sliced only: perhaps never whole
            continue
        run(index)
    outs = []
    for i, v in enumerate(jaxpr.outvars):
        if i in sliced_outs:
            outs.append(varying(read_sliced(v, sliced_outs[i])))
        else:
            outs.append(read(v))
    return outs
