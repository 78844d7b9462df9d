"""Which outputs of a replica function are the same on every replica.

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
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from jaxdist._jax_compat import (
    JAX_VERSION,
    aval_varying_axes,
    collective_axes,
    cond_branches,
    define_cast_primitive,
    has_axis_index_groups,
    is_literal,
    is_symbolic_zero,
    primitive_name,
    scan_layout,
    sub_jaxprs,
    symbolic_zero,
    while_layout,
    with_varying_axes,
)

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

# The primitive names below are spelled as `jaxdist._jax_compat.primitive_name` gives
# them; tests/package/test_jax_compat.py checks each against the installed JAX.

# Primitives that can make replicas differ even when their inputs are identical on
# every replica.
SOURCES = frozenset(
    {
        "axis_index",
        "ppermute",
        "all_to_all",
        "ragged_all_to_all",
        "reduce_scatter",
        "unreduced_reduce_scatter",
        "rng_uniform",
        "pure_callback",
        "io_callback",
    }
)
# Collectives that reduce over replicas: the result is the same on every replica of the
# axes reduced over, whatever the inputs.
REDUCING = frozenset(
    {"psum", "psum_invariant", "pmax", "pmin", "unreduced_psum", "unreduced_pmax", "unreduced_pmin"}
)
# Collectives that gather every replica's value: the same everywhere once gathered over
# every replica axis.
GATHERING = frozenset({"all_gather", "all_gather_invariant"})
# Collectives whose result is identical on every replica when their inputs are.
SAFE_COLLECTIVES = (
    REDUCING
    | GATHERING
    | frozenset(
        {
            "all_gather_reduced",
            "pbroadcast",
            "pvary",
            "preduced",
            "reduced_vary_cast",
            "vary_unreduced_cast",
            "jaxdist_assume_invariant",
        }
    )
)
# Call-like primitives: one sub-jaxpr whose inputs and outputs are the equation's.
CALLS = frozenset(
    {"jit", "closed_call", "remat2", "custom_jvp_call", "custom_vjp_call", "custom_lin"}
)
# Higher-order primitives whose operand layout the analysis reads.
CONTROL_FLOW = frozenset({"scan", "while", "cond"})
# Names that only some supported JAX releases define: name -> [first, last) (major,
# minor) release that has it (checked by tests/package/test_jax_compat.py).
VERSION_SPECIFIC: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "unreduced_pmax": ((0, 12), (99, 0)),
    "unreduced_pmin": ((0, 12), (99, 0)),
    "closed_call": ((0, 0), (0, 12)),
}

_warned: set[str] = set()
_warn_lock = threading.Lock()


def _not_understood(eqn: Any, args: list[ValueInfo], why: str) -> list[ValueInfo]:
    """The safe answer for an equation the analysis cannot read: every output may differ
    between replicas (it then takes the varying-state path). Warns once per primitive."""
    name = primitive_name(eqn)
    with _warn_lock:
        first = name not in _warned
        _warned.add(name)
    if first:
        warnings.warn(
            f"jaxdist: the replica-invariance analysis does not understand the primitive "
            f"{name!r} ({why}) of jax {JAX_VERSION}; its outputs are treated as possibly "
            "different per replica, so state computed from them comes back averaged or "
            "per replica instead of as one replicated copy. Results stay correct; please "
            "report this with your JAX version.",
            RuntimeWarning,
            stacklevel=2,
        )
    deps = _join_all(args).deps
    return [ValueInfo(True, deps)] * len(eqn.outvars)


def _typed_varying(aval: Any, axes: frozenset[str]) -> bool:
    return bool(aval_varying_axes(aval) & axes)


def _is_source(eqn: Any) -> bool:
    name = primitive_name(eqn)
    if name in SOURCES:
        return True
    if name in SAFE_COLLECTIVES:
        return False
    # An unknown collective: assume it can make replicas differ.
    return collective_axes(eqn) is not None


def _contains_source(jaxprs: Iterable[Any]) -> bool:
    for j in jaxprs:
        for eqn in j.eqns:
            if _is_source(eqn) or _contains_source(sub_jaxprs(eqn)):
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
        if is_literal(a):
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
    name = primitive_name(eqn)
    n_out = len(eqn.outvars)
    everything = _join_all(args)
    if name == "pvary":
        return args  # a cast of the type: the value does not change
    if _is_source(eqn):
        return [ValueInfo(True, everything.deps)] * n_out
    if _reduces_over(eqn, axes):  # psum & co. over every replica axis: the same everywhere
        return [ValueInfo(False, everything.deps)] * n_out
    subs = sub_jaxprs(eqn)
    if not subs:
        return [everything] * n_out
    if name in CALLS:
        if len(subs) == 1 and len(subs[0].invars) == len(args):
            outs = _walk(subs[0], args, axes)
            if len(outs) == n_out:
                return outs
        return _opaque(eqn, args, subs)
    if name == "scan":
        return _scan(eqn, args, axes)
    if name == "while":
        return _while(eqn, args, axes)
    if name == "cond":
        return _cond(eqn, args, axes)
    return _opaque(eqn, args, subs)


def _opaque(eqn: Any, args: list[ValueInfo], subs: list[Any]) -> list[ValueInfo]:
    """Any other higher-order primitive (``scatter-add``'s combiner, ``sort``'s comparator,
    a custom one): every output depends on every input. That is exact when its jaxprs hold
    no collective or other source of differences (then it is a fixed function of its
    inputs); when they do, the analysis cannot follow them, and says so."""
    if _contains_source(subs):
        return _not_understood(eqn, args, "a higher-order primitive with collectives inside")
    return [_join_all(args)] * len(eqn.outvars)


def _scan(eqn: Any, args: list[ValueInfo], axes: frozenset[str]) -> list[ValueInfo]:
    layout = scan_layout(eqn)
    subs = sub_jaxprs(eqn)
    if layout is None or len(subs) != 1 or len(subs[0].invars) != len(args):
        return _not_understood(eqn, args, "an unknown scan parameter layout")
    (body,), (nc, nk) = subs, layout
    consts, carry, xs = args[:nc], args[nc : nc + nk], args[nc + nk :]

    def scan_step(c: list[ValueInfo]) -> list[ValueInfo]:
        return _walk(body, [*consts, *c, *xs], axes)[:nk]

    carry = _fixed_point_carry(scan_step, list(carry))
    return _walk(body, [*consts, *carry, *xs], axes)


def _while(eqn: Any, args: list[ValueInfo], axes: frozenset[str]) -> list[ValueInfo]:
    layout = while_layout(eqn)
    if layout is None:
        return _not_understood(eqn, args, "an unknown while parameter layout")
    cond_j, body_j, cn, bn = layout
    c_consts, b_consts, carry = args[:cn], args[cn : cn + bn], args[cn + bn :]

    def while_step(c: list[ValueInfo]) -> list[ValueInfo]:
        return _walk(body_j, [*b_consts, *c], axes)

    carry = _fixed_point_carry(while_step, list(carry))
    (pred,) = _walk(cond_j, [*c_consts, *carry], axes)
    if pred.varying:  # replicas may loop a different number of times
        return [ValueInfo(True, c.deps | pred.deps, True) for c in carry]
    return [ValueInfo(c.varying, c.deps | pred.deps, c.control) for c in carry]


def _cond(eqn: Any, args: list[ValueInfo], axes: frozenset[str]) -> list[ValueInfo]:
    branches = cond_branches(eqn)
    if not branches or any(len(b.invars) != len(args) - 1 for b in branches):
        return _not_understood(eqn, args, "an unknown cond parameter layout")
    index, ops = args[0], args[1:]
    branch_outs = [_walk(b, ops, axes) for b in branches]
    outs = [_join_all(col) for col in zip(*branch_outs, strict=True)]
    if index.varying:  # replicas may take different branches
        return [ValueInfo(True, o.deps | index.deps, True) for o in outs]
    return [ValueInfo(o.varying, o.deps | index.deps, o.control) for o in outs]


def _reduces_over(eqn: Any, axes: frozenset[str]) -> bool:
    """A reduction (or a full all-gather) over every replica axis, in one group."""
    name = primitive_name(eqn)
    if name not in REDUCING and name not in GATHERING:
        return False
    if has_axis_index_groups(eqn):
        return False
    names = collective_axes(eqn)
    return names is not None and axes <= frozenset(names)


def analyze(
    jaxpr: Any,
    axes: str | Sequence[str],
    tracked: Sequence[int] = (),
    blocks: Sequence[int] = (),
) -> list[ValueInfo]:
    """`ValueInfo` for each output of ``jaxpr`` (an open `jax.extend.core.Jaxpr`).

    Its inputs are the replica-local inputs of a ``shard_map`` body over the
    replica ``axes``: an input typed varying is per-replica data, except those at
    the positions in ``blocks``: each device's block of one array stored sharded,
    which the function all-gathers before any other use (`jaxdist._run.stored`), so
    the same value everywhere. Dependence is tracked for the input positions in
    ``tracked`` (bit ``k`` for ``tracked[k]``).
    """
    axis_set = frozenset((axes,) if isinstance(axes, str) else axes)
    bit = {pos: 1 << k for k, pos in enumerate(tracked)}
    shared = set(blocks)
    ins = [
        ValueInfo(i not in shared and _typed_varying(v.aval, axis_set), bit.get(i, 0))
        for i, v in enumerate(jaxpr.invars)
    ]
    return _walk(jaxpr, ins, axis_set)


# The no-op cast ------------------------------------------------------------------


def _abstract_eval(aval: Any, *, axes: tuple[str, ...]) -> Any:
    return with_varying_axes(aval, aval_varying_axes(aval) - frozenset(axes))


def _transpose(ct: Any, x: Any, *, axes: tuple[str, ...]) -> tuple[Any]:
    # The value is identical on every replica, so it equals its mean over replicas:
    # transpose as pmean does (broadcast the cotangent, divided by the replica count).
    n = 1
    for a in axes:
        n *= jax.lax.axis_size(a)
    if is_symbolic_zero(ct):
        return (symbolic_zero(x.aval),)
    return (jax.lax.pcast(ct, axes, to="varying") / n,)


_bind_assume_invariant = define_cast_primitive(
    "jaxdist_assume_invariant", _abstract_eval, _transpose
)


def assume_invariant(x: Any, axes: str | Sequence[str]) -> Any:
    """Re-types ``x``, whose value `analyze` proved identical on every replica, as
    invariant over ``axes``. Costs nothing at run time."""
    axis_tuple = (axes,) if isinstance(axes, str) else tuple(axes)
    present = aval_varying_axes(jax.typeof(x))
    cast = tuple(a for a in axis_tuple if a in present)
    if not cast:
        return x
    return _bind_assume_invariant(x, axes=cast)
