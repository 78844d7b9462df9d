"""Which outputs of a replica function are the same on every replica (private).

JAX's varying-axes types say when a value is *typed* invariant: the result of
a ``psum``, a replicated input. jaxdist casts broadcast inputs to varying on
entry, so that ``jax.grad`` inside the replica function gives each replica its
own gradient, as tf.distribute does. The price is that everything computed
from those inputs is typed varying too, even when every replica computes the
very same value: parameters updated from all-reduced gradients, optimizer
state, step counters.

`analyze` walks the replica function's jaxpr and finds the outputs whose
*value* cannot differ between replicas: a value differs only if it depends on
per-replica data (a `PerReplica` argument, an ``ON_READ`` copy) or on a
primitive that makes replicas differ (``axis_index``, ``ppermute``,
``all_to_all``, ``psum_scatter``, host callbacks, ...). A ``pvary`` (the cast
to varying) changes the type, not the value. Control flow is followed: loops
to a fixed point, and a ``cond``/``while`` whose predicate differs between
replicas makes everything it produces differ.

`assume_invariant` then re-types such an output as invariant. It lowers to
nothing: the value is already identical on every device, so no collective is
needed (its transpose is that of ``pmean``). This is how updated parameters
come back as one replicated copy at the cost of the gradient all-reduce alone.

The analysis also records which inputs each output depends on, which `run`
uses to carry a padded batch's valid-row counts to the outputs computed from
it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from jaxdist._jax_compat import aval_varying_axes, with_varying_axes

__all__ = ["ValueInfo", "analyze", "assume_invariant"]


@dataclasses.dataclass(frozen=True)
class ValueInfo:
    """What the analysis knows of one value.

    Attributes:
        varying: the value may differ between replicas.
        deps: bit ``i`` is set when the value depends on input ``i`` (for the
            inputs that `analyze` was asked to track).
        control: it differs because replicas took different control-flow paths
            (a ``while`` trip count, a ``cond`` branch chosen per replica), which
            JAX's types do not record: it may be typed invariant and still differ.
    """

    varying: bool
    deps: int = 0
    control: bool = False

    def join(self, other: ValueInfo) -> ValueInfo:
        return ValueInfo(
            self.varying or other.varying,
            self.deps | other.deps,
            self.control or other.control,
        )


_INVARIANT = ValueInfo(False, 0)

# Primitives that can make replicas differ even when their inputs are identical on
# every replica.
_SOURCES = frozenset(
    {
        "axis_index",
        "ppermute",
        "all_to_all",
        "ragged_all_to_all",
        "reduce_scatter",
        "psum_scatter",
        "unreduced_reduce_scatter",
        "rng_uniform",
        "pure_callback",
        "io_callback",
    }
)
# Collectives that reduce over replicas: the result is the same on every replica of the
# axes reduced over, whatever the inputs.
_REDUCING = frozenset({"psum", "psum_invariant", "pmax", "pmin", "unreduced_psum"})
# Collectives whose result is identical on every replica when their inputs are.
_SAFE_COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "pmean",
        "all_gather",
        "all_gather_invariant",
        "all_gather_reduced",
        "unreduced_psum",
        "pbroadcast",
        "pvary",
        "preduced",
        "reduced_vary_cast",
        "vary_unreduced_cast",
        "jaxdist_assume_invariant",
    }
)
# Call-like primitives: one sub-jaxpr whose inputs and outputs are the equation's.
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "custom_lin",
    }
)


def _typed_varying(aval: Any, axes: frozenset[str]) -> bool:
    return bool(aval_varying_axes(aval) & axes)


def _is_source(eqn: Any) -> bool:
    name = eqn.primitive.name
    if name in _SOURCES:
        return True
    if name in _SAFE_COLLECTIVES:
        return False
    # An unknown collective: assume it can make replicas differ.
    return "axis_name" in eqn.params


def _contains_source(jaxprs: Iterable[Any]) -> bool:
    for j in jaxprs:
        for eqn in j.eqns:
            if _is_source(eqn) or _contains_source(jcore.jaxprs_in_params(eqn.params)):
                return True
    return False


def _join_all(infos: Iterable[ValueInfo]) -> ValueInfo:
    out = _INVARIANT
    for i in infos:
        out = out.join(i)
    return out


def _walk(jaxpr: Any, ins: Sequence[ValueInfo], axes: frozenset[str]) -> list[ValueInfo]:
    env: dict[Any, ValueInfo] = {}

    def read(a: Any) -> ValueInfo:
        if isinstance(a, jcore.Literal):
            return _INVARIANT
        info = env.get(a)
        if info is None:  # a constvar: closed-over arrays are the same everywhere
            return ValueInfo(_typed_varying(a.aval, axes))
        return info

    for v, info in zip(jaxpr.invars, ins, strict=True):
        env[v] = info
    for eqn in jaxpr.eqns:
        args = [read(a) for a in eqn.invars]
        outs = _eqn(eqn, args, axes)
        for ov, info in zip(eqn.outvars, outs, strict=True):
            # A value typed invariant is the same everywhere, whatever it came from,
            # unless replicas reached it by different control-flow paths.
            if info.varying and not info.control and not _typed_varying(ov.aval, axes):
                info = ValueInfo(False, info.deps)
            env[ov] = info
    return [read(v) for v in jaxpr.outvars]


def _fixed_point_carry(step: Any, carry: list[ValueInfo], max_iters: int = 64) -> list[ValueInfo]:
    """Joins ``carry`` with ``step(carry)`` until nothing changes."""
    for _ in range(max_iters):
        new = [c.join(s) for c, s in zip(carry, step(carry), strict=True)]
        if new == carry:
            return carry
        carry = new
    return [ValueInfo(True, c.deps, c.control) for c in carry]  # pragma: no cover


def _eqn(eqn: Any, args: list[ValueInfo], axes: frozenset[str]) -> list[ValueInfo]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    everything = _join_all(args)
    if name == "pvary":
        return args  # a cast of the type: the value does not change
    if _is_source(eqn):
        return [ValueInfo(True, everything.deps)] * n_out
    params = eqn.params
    if _reduces_over(eqn, axes):  # psum & co. over every replica axis: the same everywhere
        return [ValueInfo(False, everything.deps)] * n_out
    subs = list(jcore.jaxprs_in_params(params))
    if not subs:
        return [everything] * n_out
    if name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(args):
        outs = _walk(subs[0], args, axes)
        if len(outs) == n_out:
            return outs
    if name == "scan":
        body = subs[0]
        nc, nk = params["num_consts"], params["num_carry"]
        consts, carry, xs = args[:nc], args[nc : nc + nk], args[nc + nk :]

        def scan_step(c: list[ValueInfo]) -> list[ValueInfo]:
            return _walk(body, [*consts, *c, *xs], axes)[:nk]

        carry = _fixed_point_carry(scan_step, list(carry))
        return _walk(body, [*consts, *carry, *xs], axes)
    if name == "while":
        cond_j, body_j = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        c_consts, b_consts, carry = args[:cn], args[cn : cn + bn], args[cn + bn :]

        def while_step(c: list[ValueInfo]) -> list[ValueInfo]:
            return _walk(body_j, [*b_consts, *c], axes)

        carry = _fixed_point_carry(while_step, list(carry))
        (pred,) = _walk(cond_j, [*c_consts, *carry], axes)
        if pred.varying:  # replicas may loop a different number of times
            return [ValueInfo(True, c.deps | pred.deps, True) for c in carry]
        return [ValueInfo(c.varying, c.deps | pred.deps, c.control) for c in carry]
    if name == "cond":
        index, ops = args[0], args[1:]
        branch_outs = [_walk(b, ops, axes) for b in subs]
        outs = [_join_all(col) for col in zip(*branch_outs, strict=True)]
        if index.varying:  # replicas may take different branches
            return [ValueInfo(True, o.deps | index.deps, True) for o in outs]
        return [ValueInfo(o.varying, o.deps | index.deps, o.control) for o in outs]
    # Any other higher-order primitive: every output depends on every input.
    if _contains_source(subs):
        return [ValueInfo(True, everything.deps)] * n_out
    return [everything] * n_out


def _reduces_over(eqn: Any, axes: frozenset[str]) -> bool:
    """A reduction (or a full all-gather) over every replica axis, in one group."""
    name = eqn.primitive.name
    if name not in _REDUCING and name not in ("all_gather", "all_gather_invariant"):
        return False
    if eqn.params.get("axis_index_groups") is not None:
        return False
    names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    names = (names,) if isinstance(names, str) else tuple(names)
    return axes <= frozenset(names)


def analyze(jaxpr: Any, axes: str | Sequence[str], tracked: Sequence[int] = ()) -> list[ValueInfo]:
    """`ValueInfo` for each output of ``jaxpr`` (an open `jax.extend.core.Jaxpr`).

    Its inputs are the replica-local inputs of a ``shard_map`` body over the
    replica ``axes``: an input typed varying is per-replica data. Dependence is
    tracked for the input positions in ``tracked`` (bit ``k`` for
    ``tracked[k]``).
    """
    axis_set = frozenset((axes,) if isinstance(axes, str) else axes)
    bit = {pos: 1 << k for k, pos in enumerate(tracked)}
    ins = [
        ValueInfo(_typed_varying(v.aval, axis_set), bit.get(i, 0))
        for i, v in enumerate(jaxpr.invars)
    ]
    return _walk(jaxpr, ins, axis_set)


# The no-op cast ------------------------------------------------------------------

assume_invariant_p = jcore.Primitive("jaxdist_assume_invariant")


def _abstract_eval(aval: Any, *, axes: tuple[str, ...]) -> Any:
    return with_varying_axes(aval, aval_varying_axes(aval) - frozenset(axes))


def _transpose(ct: Any, x: Any, *, axes: tuple[str, ...]) -> tuple[Any]:
    # The value is identical on every replica, so it equals its mean over replicas:
    # transpose as pmean does (broadcast the cotangent, divided by the replica count).
    n = 1
    for a in axes:
        n *= jax.lax.axis_size(a)
    if isinstance(ct, ad.Zero):
        return (ad.Zero(x.aval),)
    return (jax.lax.pcast(ct, axes, to="varying") / n,)


def _batch(vals: Sequence[Any], dims: Sequence[Any], *, axes: tuple[str, ...]) -> Any:
    (x,), (d,) = vals, dims
    return assume_invariant_p.bind(x, axes=axes), d


assume_invariant_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(assume_invariant_p, lambda ctx, x, *, axes: [x])
ad.deflinear2(assume_invariant_p, _transpose)
batching.primitive_batchers[assume_invariant_p] = _batch


def assume_invariant(x: Any, axes: str | Sequence[str]) -> Any:
    """Re-types ``x``, whose value `analyze` proved identical on every replica, as
    invariant over ``axes``. Costs nothing at run time."""
    axis_tuple = (axes,) if isinstance(axes, str) else tuple(axes)
    present = aval_varying_axes(jax.typeof(x))
    cast = tuple(a for a in axis_tuple if a in present)
    if not cast:
        return x
    return assume_invariant_p.bind(x, axes=cast)
