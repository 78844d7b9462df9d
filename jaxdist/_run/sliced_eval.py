"""Evaluating a replica function's jaxpr when some outputs are wanted as one slice.

Sharded training state (`jaxdist.experimental.FSDPStrategy`, `MeshStrategy`)
leaves a step as each device's block of an output that is the same on every
replica: the updated parameters and optimizer state. A block is a `Cut`
(`jaxdist._run.stored`): dimensions split over replica axes. Computing the whole output on every
device and then slicing it repeats the optimizer's work ``n`` times and keeps a
gathered copy of the optimizer state alive. `eval_sliced` instead pushes the
slice up the jaxpr (nested ``jit`` equations evaluated in line first),
through element-wise equations, as XLA's partitioner would for a global-view
program:

- an element-wise equation whose result is only needed sliced (by one cut)
  runs on the slices of its operands (scalar operands whole);
- the slice of an ``all_gather`` (tiled, over the cut's axes, along its one
  dimension) is the gathered operand itself: the device's own block, so the
  optimizer state is never gathered;
- the slice of a ``psum`` over replica axes (the all-reduced gradients) that
  is needed whole nowhere, cut along one dimension over some of those axes, is
  a ``psum_scatter`` over the cut's axes (a reduce-scatter: half the traffic
  of the all-reduce), then a ``psum`` over the others; a ``psum`` of several
  operands (a gradient tree) is taken operand by operand, so a replicated
  leaf's whole sum leaves the others' slices alone (XLA combines the sums
  that remain);
- any other value is computed whole and sliced with ``dynamic_slice`` at the
  replica's index.

A slice of a sum of a transpose (autodiff's gradient of a kernel used as
``x @ w`` is one) is the transposed block of the sum of the transpose's
operand: the reduce-scatter reads the matmul's result, and only a block is
transposed. Measured on a 4-layer decoder at (data, fsdp, tensor) = (1, 8, 1),
with `jaxdist._run.stored.scatter_sum` scattering leading dimensions: 0.93 of
the hand-written step's throughput without this, 0.94-1.03 with it (0.79
with neither). A whole sum of a transpose is left as written: taken before the
transpose it measured about 15% slower under pure data parallelism.

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

from jaxdist._jax_compat import axis_names, is_literal, primitive_name
from jaxdist._run.stored import Stored, local_block, scatter_sum, to_varying, transposed

__all__ = ["eval_sliced"]

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
# Sharding constraints over the automatic axes (`jaxdist._run.stored`): a slice of one is
# the same constraint on the slice.
CONSTRAINTS = frozenset({"sharding_constraint"})


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _sliceable(eqn: Any, out_shape: tuple[int, ...]) -> bool:
    name = primitive_name(eqn)
    if name == "broadcast_in_dim":
        return not _shape(eqn.invars[0])
    if name not in ELEMENTWISE and name not in CASTS and name not in CONSTRAINTS:
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


def _gathers(eqn: Any, cut: tuple[int, tuple[str, ...], int]) -> bool:
    """``eqn`` is the gather of one cut on entry (`jaxdist._run.stored.gather`): a tiled
    ``all_gather`` over the cut's axes along its dimension, alone or in a nested
    ``shard_map`` over the automatic axes (casts before it)."""
    d, axes, _ = cut
    if primitive_name(eqn) == "shard_map":
        inner = eqn.params.get("jaxpr")
        eqns = getattr(inner, "eqns", None)
        if not eqns or len(eqn.invars) != 1 or len(eqn.outvars) != 1:
            return False
        *casts, last = eqns
        if any(primitive_name(e) not in CASTS for e in casts):
            return False
        if list(inner.outvars) != list(last.outvars):
            return False
        eqn = last
    return (
        primitive_name(eqn) == "all_gather"
        and bool(eqn.params.get("tiled"))
        and eqn.params.get("all_gather_dimension") == d
        and axis_names(eqn.params.get("axis_name")) == axes
        and eqn.params.get("axis_index_groups") is None
    )


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
    jaxpr: Any, sliced_outs: dict[int, Stored]
) -> tuple[set[Any], dict[Any, set[Stored]], dict[int, Stored]]:
    """(vars needed whole, vars needed sliced -> cuts, equation index -> cut it runs
    sliced by), by a walk from the outputs back."""
    whole: set[Any] = set()
    sliced: dict[Any, set[Stored]] = {}
    eqn_dims: dict[int, Stored] = {}
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
    sliced_outs: dict[int, Stored],
    axis: str | tuple[str, ...],
) -> list[Any]:
    """Evaluates ``jaxpr`` (inside ``shard_map``, manual over the replica axes ``axis``);
    output ``i`` in ``sliced_outs`` comes back as this device's block of the layout
    ``sliced_outs[i]`` (its cut), the others whole."""
    if any(primitive_name(e) in JITS for e in jaxpr.eqns):
        closed = jax.make_jaxpr(functools.partial(_inlined, jaxpr, consts))(*args)
        jaxpr, consts = closed.jaxpr, closed.consts
    whole, _, eqn_dims = _demand(jaxpr, sliced_outs)
    env: dict[Any, Any] = {}
    senv: dict[tuple[Any, Stored], Any] = {}
    producer: dict[Any, int] = {}
    deferred: set[int] = set()

    def read(a: Any) -> Any:
        if is_literal(a):
            return a.val
        if a not in env:  # deferred: needed whole after all
            index = producer[a]
            eqn = jaxpr.eqns[index]
            if primitive_name(eqn) in SUMS and len(eqn.outvars) > 1:
                # One operand of a sum of several (a gradient tree's all-reduce): that
                # sum alone, so the other operands may still be reduce-scattered.
                i = eqn.outvars.index(a)
                env[a] = _bind(eqn, [read(eqn.invars[i])])[0]
            else:
                run(index)
        return env[a]

    def varying(x: Any) -> Any:
        return to_varying(jax.numpy.asarray(x), axis)

    def read_sliced(a: Any, layout: Stored) -> Any:
        if is_literal(a):
            return a.val
        key = (a, layout)
        if key in senv:
            return senv[key]
        index = producer.get(a)
        eqn = None if index is None else jaxpr.eqns[index]
        one = layout.cut[0] if len(layout.cut) == 1 else None
        if eqn is not None and one is not None and _gathers(eqn, one):
            value = read(eqn.invars[0])  # the device's own block
        elif (
            eqn is not None
            and one is not None
            and primitive_name(eqn) in SUMS
            and set(one[1]) <= set(axis_names(eqn.params.get("axes", ())))
            and eqn.params.get("axis_index_groups") is None
            and a not in env
        ):  # a sum over the replicas of which each keeps a slice: a reduce-scatter
            value = reduce_scattered(eqn.invars[eqn.outvars.index(a)], layout, eqn)
        elif index is not None and index in eqn_dims:
            run_sliced(index)
            value = senv[key]
        else:
            value = local_block(read(a), layout.cut)
        senv[key] = value
        return value

    def reduce_scattered(operand: Any, layout: Stored, eqn: Any) -> Any:
        """This device's block of the sum ``eqn`` of ``operand``; when ``operand`` is
        ``lax.transpose(y, permutation)``, the transposed block of the sum of ``y``."""
        axes = axis_names(eqn.params["axes"])
        index = None if is_literal(operand) else producer.get(operand)
        source = None if index is None else jaxpr.eqns[index]
        if source is None or primitive_name(source) != "transpose":
            return scatter_sum(read(operand), layout, axes)
        permutation = tuple(source.params["permutation"])
        block = scatter_sum(read(source.invars[0]), transposed(layout, permutation), axes)
        return lax.transpose(block, permutation)

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
            block = list(shape)
            for dim, _, blocks in d.cut:
                block[dim] //= blocks
            value = varying(lax.broadcast_in_dim(read(eqn.invars[0]), tuple(block), ()))
        elif name in CASTS:
            value = read_sliced(eqn.invars[0], d)
        elif name in CONSTRAINTS:
            value = _bind(eqn, [read_sliced(eqn.invars[0], d)])
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
        if _pure(eqn) and (
            not any(v in whole for v in eqn.outvars)
            or (primitive_name(eqn) in SUMS and len(eqn.outvars) > 1)
        ):
            deferred.add(index)  # needed sliced only (or per operand): perhaps never whole
            continue
        run(index)
    outs = []
    for i, v in enumerate(jaxpr.outvars):
        if i in sliced_outs:
            outs.append(varying(read_sliced(v, sliced_outs[i])))
        else:
            outs.append(read(v))
    return outs
