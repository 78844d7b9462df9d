"""A sum of a transposed matmul, as `jaxdist._run.sliced_eval.eval_sliced` evaluates it.

Autodiff's gradient of a kernel used as ``x @ w`` is a transpose of a matmul's
result. `eval_sliced` sums the matmul with its operands swapped instead (the
same values, no transpose) when the transpose only swaps the matmul's free
dimensions and neither is read elsewhere. Each case is checked against the same
sum in NumPy (float32, relative tolerance 1e-5) and by the equation that
produces the summed value, on 8 simulated devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._jax_compat import primitive_name
from jaxdist._run.sliced_eval import eval_sliced

RTOL = 1e-5


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("i",), devices=jax.devices()[:8])


def _evaluated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (per device, summing over ``i``) traced, then run through `eval_sliced`, on
    8 devices: each argument's leading dimension is the device's."""

    def body(*blocks: jax.Array) -> list[jax.Array]:
        local = [b[0] for b in blocks]
        closed = jax.make_jaxpr(fn)(*local)
        return eval_sliced(closed.jaxpr, closed.consts, local, {}, "i")

    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P()))


def _eqns(jaxpr: Any) -> list[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found.extend(_eqns(inner))
    return found


def _summed_from(run: Callable[..., Any], *args: Any) -> list[str]:
    """The primitive producing each operand of each ``psum`` in ``run``'s program."""
    eqns = _eqns(jax.make_jaxpr(run)(*args).jaxpr)
    producer = {v: e for e in eqns for v in e.outvars}
    return [
        primitive_name(producer[a]) if a in producer else "argument"
        for e in eqns
        if primitive_name(e) in ("psum", "psum_invariant")
        for a in e.invars
    ]


def _inputs(*shapes: tuple[int, ...]) -> tuple[list[np.ndarray], list[jax.Array]]:
    """Per-device values (leading dimension 8), in NumPy and on the devices."""
    rng = np.random.default_rng(0)
    sharding = NamedSharding(_mesh(), P("i"))
    host = [rng.normal(size=(8, *shape)).astype(np.float32) for shape in shapes]
    return host, [jax.device_put(x, sharding) for x in host]


@pytest.mark.parametrize(
    ("shapes", "contract", "permutation"),
    [
        (((16, 4), (16, 6)), ((0,), (0,)), (1, 0)),  # a kernel gradient, x^T dy
        (((2, 8, 4), (2, 8, 6)), ((0, 1), (0, 1)), (1, 0)),  # over batch and length
        (((3, 5, 4), (4, 6)), ((2,), (0,)), (2, 0, 1)),  # two free dimensions on the left
        (((4, 3, 5), (6, 4)), ((0,), (1,)), (2, 0, 1)),  # contracting the right's last
    ],
)
def test_a_sum_of_a_transposed_matmul_sums_the_swapped_matmul(
    shapes: tuple[tuple[int, ...], ...],
    contract: tuple[tuple[int, ...], tuple[int, ...]],
    permutation: tuple[int, ...],
) -> None:
    def fn(a: jax.Array, b: jax.Array) -> jax.Array:
        dot = lax.dot_general(a, b, (contract, ((), ())))
        return lax.psum(lax.transpose(dot, permutation), "i")

    run = _evaluated(fn)
    (x, y), (a, b) = _inputs(*shapes)
    assert _summed_from(run, a, b) == ["dot_general"]
    want = sum(np.transpose(np.tensordot(x[d], y[d], contract), permutation) for d in range(8))
    (got,) = run(a, b)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=RTOL)


def test_the_swapped_matmul_keeps_the_precision_of_each_operand() -> None:
    def fn(a: jax.Array, b: jax.Array) -> jax.Array:
        precision = (lax.Precision.HIGHEST, lax.Precision.DEFAULT)
        dot = lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision)
        return lax.psum(dot.T, "i")

    _, (a, b) = _inputs((16, 4), (16, 6))
    eqns = _eqns(jax.make_jaxpr(_evaluated(fn))(a, b).jaxpr)
    dots = [e for e in eqns if primitive_name(e) == "dot_general"]
    # Traced once as written (left for XLA to drop), once swapped: the one summed.
    swapped = dots[-1]
    assert swapped.params["dimension_numbers"] == (((0,), (0,)), ((), ()))
    assert _shape(swapped) == (6, 4)
    assert tuple(swapped.params["precision"]) == (lax.Precision.DEFAULT, lax.Precision.HIGHEST)


def _shape(eqn: Any) -> tuple[int, ...]:
    return tuple(eqn.outvars[0].aval.shape)


@pytest.mark.parametrize(
    "case",
    ["transpose_read_elsewhere", "matmul_read_elsewhere", "batch_dimensions", "not_a_swap"],
)
def test_other_transposes_are_summed_as_written(case: str) -> None:
    """No swap where it would add a matmul (the transpose or the matmul is read
    elsewhere) or change what is summed (batch dimensions; a permutation that is not
    the swap of the two operands' free dimensions)."""
    contract = ((0,), (0,))
    batch: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    shapes: tuple[tuple[int, ...], ...] = ((16, 4), (16, 6))
    permutation = (1, 0)
    if case == "batch_dimensions":
        shapes, contract, batch = ((3, 16, 4), (3, 16, 6)), ((1,), (1,)), ((0,), (0,))
        permutation = (0, 2, 1)
    elif case == "not_a_swap":
        shapes, contract, permutation = ((3, 5, 4), (4, 6)), ((2,), (0,)), (1, 0, 2)

    def fn(a: jax.Array, b: jax.Array) -> Any:
        dot = lax.dot_general(a, b, (contract, batch))
        t = lax.transpose(dot, permutation)
        if case == "transpose_read_elsewhere":
            return lax.psum(t, "i"), lax.psum(jnp.sum(t), "i")
        if case == "matmul_read_elsewhere":
            return lax.psum(t, "i"), lax.psum(jnp.sum(dot * dot), "i")
        return lax.psum(t, "i")

    run = _evaluated(fn)
    (x, y), (a, b) = _inputs(*shapes)
    assert _summed_from(run, a, b)[0] == "transpose"
    dots = [e for e in _eqns(jax.make_jaxpr(run)(a, b).jaxpr) if primitive_name(e) == "dot_general"]
    assert len(dots) == 1
    per_device = [
        np.transpose(
            np.einsum("bti,btj->bij", x[d], y[d])
            if case == "batch_dimensions"
            else np.tensordot(x[d], y[d], contract),
            permutation,
        )
        for d in range(8)
    ]
    got = run(a, b)
    np.testing.assert_allclose(np.asarray(got[0]), sum(per_device), rtol=RTOL, atol=RTOL)
