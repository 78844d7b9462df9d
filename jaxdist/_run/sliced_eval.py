"""Evaluating a replica function's jaxpr (every step's), some outputs wanted as one slice.

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

Sums read matmuls in the order they are stored. Autodiff's gradient of a
kernel used as ``x @ w`` is a transpose of a matmul's result, and a collective
of a transpose keeps the transposed memory layout, which XLA's CPU backend
carries back into the matmul and then leaves outside its fast (XNNPACK)
fusions: 16 to 28 bare ``dot`` ops in a 4-layer decoder's step, against the
hand-written step's 4. So:

- a sum (whole or sliced) of a transpose that only swaps a matmul's free
  dimensions, neither read elsewhere, sums the matmul with its operands
  swapped: the same values, one matmul, no transpose;
- a slice of a sum of another transpose whose operand is cut along its
  leading dimension is the transposed block of the sum of the operand: the
  reduce-scatter reads the matmul's result, and only a block is transposed.

With both, every mesh shape's step has 4 ``dot`` ops, as the hand-written
one has. Measured on that decoder (`benchmarks/mesh.py`, 2 CPU cores),
MeshStrategy / hand-written throughput went from 0.94-0.97 to 0.98-1.10 at
(2, 1, 4) and from 0.93-1.01 to 1.03-1.12 at (2, 2, 2) (the swap; four runs
with it); the slice of a transposed sum took (1, 8, 1) from 0.79 to about
0.94 before. Run-to-run spread is about 7%, as the unchanged (1, 1, 8) shows.

The values computed are those of slicing the whole results (element-wise
operations commute with slicing; a reduce-scatter adds the same terms as the
all-reduce, possibly in another order), so the step's results do not change
beyond float rounding; only the work, the traffic and the memory do. Equations are evaluated in
order; one whose results are needed sliced only is evaluated whole only if a
slice of it cannot be had otherwise.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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


def _free_dims(dot: Any) -> tuple[int, int]:
    """The number of free (not contracted) dimensions of each operand of ``dot``."""
    (lc, rc), _ = dot.params["dimension_numbers"]
    return len(_shape(dot.invars[0])) - len(lc), len(_shape(dot.invars[1])) - len(rc)


def _swaps_free_dims(transpose: Any, dot: Any) -> bool:
    """Whether ``transpose`` of the result of ``dot`` (a ``dot_general``) only swaps its
    free dimensions: no batch dimensions, the right operand's in front of the left's. It
    is then ``dot`` with its operands swapped (`_swapped_dot`)."""
    _, (lb, _) = dot.params["dimension_numbers"]
    nl, nr = _free_dims(dot)
    permutation = tuple(transpose.params["permutation"])
    out = dot.params.get("out_sharding")
    return (
        not lb
        and permutation == (*range(nl, nl + nr), *range(nl))
        and (
            out is None
            or (
                isinstance(out, NamedSharding)
                and not getattr(out.spec, "unreduced", None)
                and not getattr(out.spec, "reduced", None)
            )
        )
    )


def _swapped_dot(dot: Any, lhs: Any, rhs: Any) -> Any:
    """``dot``'s result transposed as `_swaps_free_dims` says, computed as one matmul: the
    ``dot_general`` of ``rhs`` and ``lhs`` (``dot``'s operands, swapped)."""
    (lc, rc), _ = dot.params["dimension_numbers"]
    precision = dot.params.get("precision")
    out = dot.params.get("out_sharding")
    if out is not None:  # the same layout, its entries in the swapped order
        nl, _ = _free_dims(dot)
        spec = [*out.spec, *[None] * (len(_shape(dot.outvars[0])) - len(out.spec))]
        out = NamedSharding(out.mesh, P(*spec[nl:], *spec[:nl]))
    return lax.dot_general(
        rhs,
        lhs,
        ((rc, lc), ((), ())),
        precision=precision[::-1] if isinstance(precision, tuple) else precision,
        preferred_element_type=dot.params.get("preferred_element_type"),
        out_sharding=out,
    )


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
    whole, needed_sliced, eqn_dims = _demand(jaxpr, sliced_outs)
    env: dict[Any, Any] = {}
    senv: dict[tuple[Any, Stored], Any] = {}
    producer: dict[Any, int] = {}
    deferred: set[int] = set()
    swapped: dict[Any, Any] = {}
    uses = collections.Counter(
        a for e in jaxpr.eqns for a in e.invars if not is_literal(a)
    ) + collections.Counter(a for a in jaxpr.outvars if not is_literal(a))

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
                env[a] = _bind(eqn, [summand(eqn.invars[i])])[0]
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

    def made_by(a: Any, name: str) -> Any:
        """The equation that produced ``a``, if it is a ``name`` read nowhere else."""
        index = None if is_literal(a) else producer.get(a)
        eqn = None if index is None else jaxpr.eqns[index]
        if eqn is None or primitive_name(eqn) != name or uses[a] != 1:
            return None
        return eqn

    def swappable_dot(a: Any) -> Any:
        """The ``dot_general`` equation when ``a`` is a transpose of its result that only
        swaps its free dimensions, and neither is read elsewhere (the swapped matmul then
        replaces the matmul, not adds to it)."""
        transpose = made_by(a, "transpose")
        dot = None if transpose is None else made_by(transpose.invars[0], "dot_general")
        return dot if dot is not None and _swaps_free_dims(transpose, dot) else None

    def summand(a: Any) -> Any:
        """``a``, an operand of a sum, as the sum reads it: a transpose of a matmul's
        result that only swaps its free dimensions is computed as the swapped matmul."""
        dot = swappable_dot(a)
        if dot is None:
            return read(a)
        if a not in swapped:
            swapped[a] = _swapped_dot(dot, read(dot.invars[0]), read(dot.invars[1]))
        return swapped[a]

    def reduce_scattered(operand: Any, layout: Stored, eqn: Any) -> Any:
        """This device's block of the sum ``eqn`` of ``operand``. When ``operand`` is
        ``lax.transpose(y, permutation)`` and ``y``'s cut is its leading dimension, the
        transposed block of the sum of ``y``; else the block of the sum of
        ``summand(operand)``."""
        axes = axis_names(eqn.params["axes"])
        index = None if is_literal(operand) else producer.get(operand)
        source = None if index is None else jaxpr.eqns[index]
        if source is not None and primitive_name(source) == "transpose":
            permutation = tuple(source.params["permutation"])
            inner = transposed(layout, permutation)
            if inner.cut[0][0] == 0 or swappable_dot(operand) is None:
                block = scatter_sum(read(source.invars[0]), inner, axes)
                return lax.transpose(block, permutation)
        return scatter_sum(summand(operand), layout, axes)

    def run(index: int) -> None:
        eqn = jaxpr.eqns[index]
        deferred.discard(index)
        read_operand = summand if primitive_name(eqn) in SUMS else read
        outs = _bind(eqn, list(map(read_operand, eqn.invars)))
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
            or (
                primitive_name(eqn) in SUMS
                and len(eqn.outvars) > 1
                and any(v in needed_sliced for v in eqn.outvars)
            )
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
