"""The CPU collective deadlock: a loop of un-waited run calls must finish, with the right values.

With 8 simulated CPU devices on 2 cores and default XLA flags, several
programs with collectives in flight at once deadlock XLA's CPU runtime, which
aborts the process after a timeout. jaxdist keeps one in flight; these loops
never wait on their results. Each loop runs in a fresh process under a time
limit, so a broken gate fails its test (with XLA's abort message) instead of
aborting the pytest session, and its results are compared with NumPy.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from _helpers import run_python

_LOOPS = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxdist as jd

    s = jd.MirroredStrategy()
    assert s.num_replicas_in_sync == 8 and s._gate
    mode = sys.argv[1]
    out = {}
    if mode == "runs":
        def step(ctx, x):
            return ctx.all_reduce("sum", x + 1.0)

        xs = [jnp.full((4,), float(i), jnp.float32) for i in range(500)]
        outs = [s.run(step, args=(x,)) for x in xs]  # never waited on
        out["outs"] = [np.asarray(o.array).tolist() for o in outs]
    elif mode == "training":
        def step(ctx, w, x):
            g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
            return w - 0.01 * ctx.all_reduce("mean", g)

        rng = np.random.default_rng(0)
        w = rng.normal(size=(16, 4)).astype(np.float32)
        x = jd.PerReplica(rng.normal(size=(8, 32, 16)).astype(np.float32))
        means = []
        for _ in range(200):
            w = s.run(step, args=(w, x))
            means.append(s.reduce("mean", w))  # another collective program, also un-waited
        out["w"] = np.asarray(w.array).tolist()
        out["means"] = [np.asarray(m).tolist() for m in means[::50]]
    elif mode == "functions":
        # strategy.function's own per-call path; outputs of every shape the gate must read
        # (a tuple holding a PerReplica and a Mirrored, a dict, a bare PerReplica).
        @s.function
        def step(ctx, x):
            return x + 1.0, {"total": ctx.all_reduce("sum", x)}

        @s.function
        def local(ctx, x):
            return x * 2.0

        x = jd.PerReplica(jnp.arange(8.0))
        for _ in range(300):
            x, metrics = step(x)
            doubled = local(x)
        out["x"] = np.asarray(x.array).tolist()
        out["total"] = np.asarray(metrics["total"].array).tolist()
        out["doubled"] = np.asarray(doubled.array).tolist()
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(300)
def test_unwaited_loop_of_500_runs() -> None:
    out = run_python(_LOOPS, "runs", timeout=240)
    expected = 8.0 * (np.arange(500, dtype=np.float32)[:, None] + 1.0) * np.ones((1, 4))
    np.testing.assert_array_equal(np.asarray(out["outs"]), expected)  # exact: small integers


def _reference_training() -> tuple[np.ndarray, list[np.ndarray]]:
    """The training loop of `_LOOPS` on one device in NumPy (float64)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 4)).astype(np.float32).astype(np.float64)
    x = rng.normal(size=(8, 32, 16)).astype(np.float32).astype(np.float64)
    seen = []
    for i in range(200):
        # grad of mean((x_r @ w) ** 2) over the 32 x 4 outputs, averaged over replicas
        g = np.mean([2.0 * xr.T @ (xr @ w) / (32 * 4) for xr in x], axis=0)
        w = w - 0.01 * g
        if i % 50 == 0:
            seen.append(w)
    return w, seen


@pytest.mark.timeout(300)
def test_unwaited_training_loop_with_reduce() -> None:
    out = run_python(_LOOPS, "training", timeout=240)
    w, seen = _reference_training()
    np.testing.assert_allclose(np.asarray(out["w"]), w, rtol=1e-4, atol=1e-5)
    assert len(out["means"]) == len(seen) == 4
    for got, want in zip(out["means"], seen, strict=True):  # the un-waited reduces too
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_unwaited_loop_of_functions_with_nested_outputs() -> None:
    out = run_python(_LOOPS, "functions", timeout=240)
    np.testing.assert_allclose(out["x"], np.arange(8.0) + 300)
    np.testing.assert_allclose(out["total"], (np.arange(8.0) + 299).sum())
    np.testing.assert_allclose(out["doubled"], 2 * (np.arange(8.0) + 300))
