"""Every JAX internal jaxdist reads (`jaxdist._jax_compat`), checked against the installed
JAX: each test fails loudly when a JAX release changes what the function reads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist import _jax_compat as compat
from jaxdist._run import invariance

AXIS = "r"


def _mesh(n: int = 4) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (AXIS,), axis_types=(AxisType.Auto,))


def _body_jaxpr(fn: Any, *args: Any, in_specs: Any = None) -> Any:
    """The jaxpr of ``fn`` as the body of a ``shard_map`` over 4 devices."""
    in_specs = P(AXIS) if in_specs is None else in_specs
    sm = jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=P(AXIS))
    (eqn,) = jax.make_jaxpr(sm)(*args).jaxpr.eqns
    (body,) = compat.sub_jaxprs(eqn)
    return body


def _eqn(jaxpr: Any, name: str) -> Any:
    found = [e for e in jaxpr.eqns if compat.primitive_name(e) == name]
    assert found, f"no {name!r} equation in {jaxpr}"
    return found[0]


# Typed varying axes --------------------------------------------------------------


def test_varying_axes_reads_the_manual_axis_type() -> None:
    seen: dict[str, Any] = {}

    def fn(x: Any) -> Any:
        total = jax.lax.psum(x, AXIS)
        seen["x"] = compat.varying_axes(x)
        seen["total"] = compat.varying_axes(total)
        seen["varies"] = (compat.varies(x, AXIS), compat.varies(total, (AXIS,)))
        aval = jax.typeof(x)
        seen["cleared"] = compat.aval_varying_axes(compat.with_varying_axes(aval, frozenset()))
        return x

    jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=P(AXIS), out_specs=P(AXIS)))(jnp.ones(4))
    assert seen["x"] == frozenset({AXIS})
    assert seen["total"] == frozenset()
    assert seen["varies"] == (True, False)
    assert seen["cleared"] == frozenset()
    assert compat.aval_varying_axes(jax.core.ShapedArray((2,), jnp.float32)) == frozenset()
    assert compat.axis_names(AXIS) == (AXIS,)
    assert compat.axis_names(("a", "b")) == ("a", "b")


# Values and tracing ---------------------------------------------------------------


def test_concrete_array_type_and_tracers() -> None:
    x = jnp.ones(3)
    assert type(x) is compat.concrete_array_type()
    assert not compat.is_tracer(x)
    seen = []
    jax.jit(lambda a: seen.append(compat.is_tracer(a)) or a)(x)
    assert seen == [True]


def test_eval_jaxpr_replays_a_traced_function() -> None:
    closed = jax.make_jaxpr(lambda a, b: (a * b + 1.0, jnp.sin(a)))(2.0, 3.0)
    out = compat.eval_jaxpr(closed.jaxpr, closed.consts, 2.0, 3.0)
    np.testing.assert_allclose(np.asarray(out[0]), 7.0)
    np.testing.assert_allclose(np.asarray(out[1]), np.sin(2.0), rtol=1e-6)


def test_all_gather_invariant_and_its_fallback_agree() -> None:
    def fn(x: Any) -> Any:
        fast = compat.all_gather_invariant(x, AXIS)
        slow = compat._all_gather_invariant_by_psum(x, AXIS)
        assert compat.varying_axes(fast) == compat.varying_axes(slow) == frozenset()
        return fast, slow

    rows = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    fast, slow = jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=P(AXIS), out_specs=(P(), P())))(
        rows
    )
    # Each replica holds a (1, 2) slice; the gather stacks them: (4, 1, 2).
    np.testing.assert_array_equal(np.asarray(fast).reshape(4, 2), rows)
    np.testing.assert_array_equal(np.asarray(slow), np.asarray(fast))


# Jaxpr equations --------------------------------------------------------------------


def test_collective_equations() -> None:
    def fn(x: Any) -> Any:
        a = jax.lax.psum(x, AXIS)
        b = jax.lax.pmax(x, AXIS)
        c = jax.lax.all_gather(x, AXIS, tiled=True)
        d = jax.lax.ppermute(x, AXIS, [(0, 1), (1, 0), (2, 3), (3, 2)])
        e = jax.lax.axis_index(AXIS)
        f = jnp.sum(x, axis=0)
        return a + b + d + e + f + c[:1]

    body = _body_jaxpr(fn, jnp.ones(4))
    names = [compat.primitive_name(e) for e in body.eqns]
    for name in ("pmax", "all_gather", "ppermute", "axis_index", "reduce_sum"):
        assert name in names, names
    assert "psum" in names or "psum_invariant" in names, names
    for name in ("pmax", "all_gather", "ppermute", "axis_index"):
        assert compat.collective_axes(_eqn(body, name)) == (AXIS,), name
        assert not compat.has_axis_index_groups(_eqn(body, name))
    # An array reduction has integer ``axes``: not a collective.
    assert compat.collective_axes(_eqn(body, "reduce_sum")) is None
    assert compat.collective_axes(_eqn(body, "add")) is None


def test_literals_and_primitive_names() -> None:
    closed = jax.make_jaxpr(lambda a: a + 2.0)(1.0)
    (eqn,) = closed.jaxpr.eqns
    assert compat.primitive_name(eqn) == "add"
    assert [compat.is_literal(a) for a in eqn.invars] == [False, True]
    assert compat.sub_jaxprs(eqn) == []


def test_scan_layout_counts_consts_and_carries() -> None:
    def fn(init: Any, xs: Any, k: Any) -> Any:
        def body(c: Any, x: Any) -> Any:
            return (c[0] + x * k, c[1] * 2.0), c[0] * x

        return jax.lax.scan(body, init, xs)

    closed = jax.make_jaxpr(fn)((1.0, 2.0), jnp.ones(3), 3.0)
    eqn = _eqn(closed.jaxpr, "scan")
    layout = compat.scan_layout(eqn)
    assert layout is not None, f"unknown scan layout on jax {jax.__version__}: {eqn.params}"
    nc, nk = layout
    (body,) = compat.sub_jaxprs(eqn)
    n_in = len(eqn.invars)
    assert len(body.invars) == n_in
    # Operands: consts, carries, then the scanned-over array (one here).
    assert nc + nk == n_in - 1
    assert nk == len(body.outvars) - 1  # carries out, then one stacked output
    assert nk >= 1


def test_while_and_cond_layouts() -> None:
    def fn(x: Any, k: Any) -> Any:
        y = jax.lax.while_loop(lambda c: c < k, lambda c: c + x, x)
        return jax.lax.cond(y > 3.0, lambda a: a * k, lambda a: a - k, y)

    closed = jax.make_jaxpr(fn)(1.0, 10.0)
    w = compat.while_layout(_eqn(closed.jaxpr, "while"))
    assert w is not None
    cond_j, body_j, cn, bn = w
    assert (cn, bn) == (1, 1)  # k in the predicate, x in the body
    assert len(cond_j.invars) == cn + 1 and len(body_j.invars) == bn + 1
    branches = compat.cond_branches(_eqn(closed.jaxpr, "cond"))
    assert branches is not None and len(branches) == 2
    assert all(len(b.invars) == 2 for b in branches)


def test_unknown_layouts_read_as_none() -> None:
    class FakeEqn:
        def __init__(self) -> None:
            self.params = {"something_new": 1}
            self.invars: list[Any] = []

    eqn = FakeEqn()
    assert compat.scan_layout(eqn) is None
    assert compat.while_layout(eqn) is None
    assert compat.cond_branches(eqn) is None


def test_every_primitive_the_analysis_names_exists_in_this_jax() -> None:
    installed = compat.installed_primitive_names()
    listed = (
        invariance.SOURCES
        | invariance.SAFE_COLLECTIVES
        | invariance.CALLS
        | invariance.CONTROL_FLOW
    ) - {"jaxdist_assume_invariant"}
    missing = sorted(listed - installed - set(invariance.VERSION_SPECIFIC))
    assert not missing, (
        f"jax {jax.__version__} has no primitive named {missing}: JAX renamed or removed "
        "them; update jaxdist/_run/invariance.py"
    )
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    for name, (low, high) in invariance.VERSION_SPECIFIC.items():
        expected = low <= version < high
        assert (name in installed) == expected, (name, low, high, jax.__version__)


def test_cast_primitive_lowers_to_nothing_and_transposes_as_pmean() -> None:
    def fn(x: Any) -> Any:
        same = jax.lax.pcast(jax.lax.psum(x, AXIS), AXIS, to="varying")
        cast = invariance.assume_invariant(same, AXIS)
        assert compat.varying_axes(cast) == frozenset()
        return cast

    x = jnp.arange(4.0)
    mesh = _mesh()
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P()))
    np.testing.assert_allclose(np.asarray(f(x)), [6.0])
    assert "jaxdist_assume_invariant" not in f.lower(x).compile().as_text()
    grad = jax.grad(lambda v: jnp.sum(f(v)))(x)
    np.testing.assert_allclose(np.asarray(grad), np.ones(4))  # d(sum x)/dx_i
    zero = compat.symbolic_zero(jax.core.ShapedArray((2,), jnp.float32))
    assert compat.is_symbolic_zero(zero) and not compat.is_symbolic_zero(jnp.zeros(2))


# Processes, backends, error texts, XLA flags --------------------------------------


def test_process_state_readers() -> None:
    jax.devices()
    assert compat.backends_initialized() is True
    assert compat.distributed_client() is None  # jax.distributed is not running here
    address, count, index = compat.distributed_cluster()
    assert address is None and index in (0, None) and count in (1, None)
    assert compat.running_in_cloud_tpu_vm() is False


def test_incompatible_devices_text_matches_jax_error() -> None:
    d0, d1 = jax.devices()[:2]
    a = jax.device_put(jnp.ones(2), d0)
    b = jax.device_put(jnp.ones(2), d1)
    with pytest.raises(ValueError) as info:
        jax.jit(lambda x, y: x + y)(a, b)
    assert compat.is_incompatible_devices(info.value), str(info.value)
    assert not compat.is_incompatible_devices(ValueError("something else"))


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )


def test_deadline_exceeded_text_matches_the_coordination_service() -> None:
    from _helpers import free_port

    code = f"""
        import jax
        from jaxdist import _jax_compat as compat
        jax.distributed.initialize("127.0.0.1:{free_port()}", num_processes=1, process_id=0)
        try:
            compat.distributed_client().blocking_key_value_get("jaxdist/absent", 50)
        except Exception as e:
            print("DEADLINE" if compat.is_deadline_exceeded(e) else "OTHER: " + str(e))
        jax.distributed.shutdown()
    """
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DEADLINE" in out.stdout, out.stdout + out.stderr[-2000:]


def test_cpu_collective_timeout_flag_is_known_to_xla() -> None:
    code = "import jax; print(len(jax.devices()))"
    ok = _run(code, {"XLA_FLAGS": f"{compat.CPU_COLLECTIVE_TIMEOUT_FLAG}=7"})
    assert ok.returncode == 0 and ok.stdout.strip() == "1", ok.stderr[-2000:]
    # The same check fails for a flag XLA does not know (so the one above means something).
    bad = _run(code, {"XLA_FLAGS": "--xla_jaxdist_no_such_flag=7"})
    assert bad.returncode != 0


def test_lean_host_placement_is_available() -> None:
    assert compat._BATCHED_DEVICE_PUT[0] is not None, "JAX moved batched_device_put"


# The analysis on what it does not understand ---------------------------------------


def test_unknown_higher_order_primitive_is_treated_as_varying_and_warns_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(invariance, "_warned", set())

    def fn(x: Any, w: Any) -> Any:
        w = jax.lax.pcast(w, AXIS, to="varying")
        y, _ = jax.lax.scan(lambda c, _: (c * 2.0, None), w, None, length=3)
        return y

    body = _body_jaxpr(fn, jnp.ones(4), jnp.ones(2), in_specs=(P(AXIS), P()))
    # Understood: a scan over replica-invariant state stays invariant.
    assert [i.varying for i in invariance.analyze(body, AXIS)] == [False]
    # A JAX whose scan parameters this jaxdist cannot read: varying, with one warning.
    monkeypatch.setattr(invariance, "scan_layout", lambda eqn: None)
    with pytest.warns(RuntimeWarning, match=r"does not understand the primitive 'scan'"):
        infos = invariance.analyze(body, AXIS)
    assert [i.varying for i in infos] == [True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        invariance.analyze(body, AXIS)  # warned once per primitive, not per trace


def test_an_unseen_primitive_takes_the_safe_path_end_to_end(
    mirrored8: jd.MirroredStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A train step with a scan on a JAX whose scan layout is unknown: the parameters still
    equal the single-device result; they are averaged on the varying path instead of being
    proven replicated."""
    monkeypatch.setattr(invariance, "_warned", set())
    monkeypatch.setattr(invariance, "scan_layout", lambda eqn: None)
    x = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(16, 4)

    def loss(w: Any, xb: Any) -> Any:
        h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), xb, None, length=2)
        return jnp.sum(h**2)

    def step(ctx: jd.ReplicaContext, w: Any, xb: Any) -> Any:
        g = jax.grad(loss)(w, xb)
        return w - 0.1 * ctx.all_reduce("sum", g)

    w0 = np.eye(4, dtype=np.float32) * 0.5
    batch = mirrored8.experimental_distribute_values_from_function(
        lambda ctx: x[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
    )
    with pytest.warns(RuntimeWarning, match="does not understand the primitive 'scan'"):
        new = mirrored8.run(step, args=(w0, batch))
    want = w0 - 0.1 * np.asarray(jax.grad(loss)(w0, x))
    np.testing.assert_allclose(np.asarray(new.values[0]), want, rtol=1e-5, atol=1e-6)
    for v in new.values:
        np.testing.assert_array_equal(np.asarray(v), np.asarray(new.values[0]))
