"""A train step donates its state: the buffers are reused, and a donated state used again
raises instead of ending the process.

Given a donated (deleted) buffer, jax 0.10's multi-device CPU programs end the process
with a segmentation fault, so the reuse tests also run in a subprocess: a regression
fails one test instead of killing pytest.
"""

from __future__ import annotations

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd

from _helpers import run_python, strategy_params

RTOL = 1e-6
DONATED = r"was donated: use the state the step returned"


def _linear_state(strategy: jd.Strategy) -> jd.TrainState:
    with strategy.scope():  # placed on the strategy's devices: the first step donates it
        return jd.TrainState.create(apply_fn=None, params={"w": jnp.arange(3.0)}, tx=optax.sgd(0.5))


def _state_step(strategy: jd.Strategy) -> jd.TrainStep:
    @jd.train_step(strategy)
    def step(ctx, state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(state.params)
        grads = ctx.all_reduce("mean", grads)
        return state.apply_gradients(grads=grads), ctx.all_reduce("sum", jnp.sum(x))

    return step


def _x(strategy: jd.Strategy) -> jd.PerReplica:
    n = strategy.num_replicas_in_sync
    return jd.PerReplica(np.arange(n * 3, dtype=np.float32).reshape(n, 3))


@pytest.mark.parametrize("make", strategy_params("one_device", "mirrored8"))
def test_reused_train_state_raises_and_the_returned_one_trains_on(make) -> None:
    strategy = make()
    step, x = _state_step(strategy), _x(strategy)
    rows = np.arange(strategy.num_replicas_in_sync * 3, dtype=np.float32).reshape(-1, 3)
    state = _linear_state(strategy)
    new, _ = step(state, x)
    with pytest.raises(
        RuntimeError,
        match=r"jaxdist\.train_step\(step\): argument `state` \(args\[0\], TrainState\) "
        + DONATED
        + r"\. Its arrays were donated to an earlier call .*\(`state, loss = step\(state, "
        r"batch\)`.*donate=False",
    ):
        step(state, x)
    newer, total = step(new, x)  # the returned state is intact and trains on
    expected = np.arange(3.0) - 2 * 0.5 * rows.mean(axis=0)  # two sgd steps, mean gradient
    np.testing.assert_allclose(np.asarray(newer.params["w"]), expected, rtol=RTOL)
    assert int(newer.step) == 2 and float(total) == rows.sum()


def test_reused_train_state_is_named_by_its_path() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    x = _x(strategy)

    @jd.train_step(strategy)
    def step(ctx, states, x, *, other=None):
        grads = ctx.all_reduce("mean", jax.grad(lambda p: jnp.sum(p["w"] * x))(states["a"].params))
        return {"a": states["a"].apply_gradients(grads=grads)}, other

    state = _linear_state(strategy)
    new, _ = step({"a": state}, x)
    with pytest.raises(RuntimeError, match=r"argument `states` \(args\[0\]\['a'\], TrainState\) "):
        step({"a": state}, x)
    kept = _linear_state(strategy)
    with pytest.raises(RuntimeError, match=r"argument `other` \(kwargs\['other'\], TrainState\) "):
        step(new, x, other=state)
    assert not kept.params["w"].is_deleted()  # nothing was dispatched by the failed calls


def _nnx_objects(strategy: jd.Strategy) -> tuple[nnx.Linear, nnx.Optimizer]:
    del strategy
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)


def _nnx_step(strategy: jd.Strategy, donate: bool = True) -> jd.TrainStep:
    @jd.train_step(strategy, donate=donate)
    def step(ctx, model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, ctx.all_reduce("mean", grads))
        return ctx.all_reduce("mean", loss)

    return step


@pytest.mark.parametrize("which", ["model", "opt"])
def test_nnx_state_restored_from_before_a_step_raises(which: str) -> None:
    strategy = jd.MirroredStrategy()
    model, opt = _nnx_objects(strategy)
    step, x = _nnx_step(strategy), _x(strategy)
    step(model, opt, x)
    target = model if which == "model" else opt
    saved = jax.tree.map(lambda a: a, nnx.state(target))  # the arrays, not copies
    step(model, opt, x)
    nnx.update(target, saved)  # arrays the last call donated
    kind, index, var = ("Linear", 0, "bias") if which == "model" else ("Optimizer", 1, "opt_state")
    with pytest.raises(
        RuntimeError,
        match=rf"argument `{which}` \(args\[{index}\], {kind}\) {DONATED}\. Its NNX variable "
        rf"{var}\S* holds an array that an earlier call of this step donated.*"
        r"jax\.tree\.map\(jnp\.copy, nnx\.state\(model\)\)",
    ):
        step(model, opt, x)


def test_nnx_state_saved_as_copies_restores_and_trains() -> None:
    strategy = jd.MirroredStrategy()
    model, opt = _nnx_objects(strategy)
    step, x = _nnx_step(strategy), _x(strategy)
    step(model, opt, x)
    saved = jax.tree.map(jnp.copy, nnx.state((model, opt)))  # the advised fix
    first = float(step(model, opt, x))
    nnx.update((model, opt), saved)
    assert float(step(model, opt, x)) == pytest.approx(first, rel=RTOL)


# -------------------------------------------------------- NNX buffers are donated


def _variables(objects: tuple) -> list:
    return [v.get_raw_value() for v in nnx.to_flat_state(nnx.state(objects)).leaves]


@pytest.mark.parametrize("make", strategy_params("one_device", "mirrored2", "mirrored8"))
def test_nnx_model_and_optimizer_buffers_are_donated(make) -> None:
    strategy = make()
    model, opt = _nnx_objects(strategy)
    step, x = _nnx_step(strategy), _x(strategy)
    step(model, opt, x)  # the first call places the state on the devices (own copies)
    before = _variables((model, opt))
    assert len(before) == 8  # kernel, bias; adam's count, mu and nu of both; the step count
    step(model, opt, x)
    assert all(a.is_deleted() for a in before)
    assert not any(a.is_deleted() for a in _variables((model, opt)))

    kept = _nnx_step(strategy, donate=False)
    before = _variables((model, opt))
    kept(model, opt, x)
    assert not any(a.is_deleted() for a in before)


def _aliased_parameters(hlo: str) -> set[int]:
    """The entry parameters the compiled program aliases to outputs."""
    match = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", hlo)
    if match is None:
        return set()
    return {int(p) for p in re.findall(r":\s*\((\d+),", match.group(1))}


def test_nnx_donation_shows_as_input_output_aliasing() -> None:
    strategy = jd.MirroredStrategy()
    model, opt = _nnx_objects(strategy)
    x = _x(strategy)
    n = len(_variables((model, opt)))
    donating = _nnx_step(strategy).lower(model, opt, x).compile().as_text()
    assert _aliased_parameters(donating) == set(range(n))  # every NNX variable, not the batch
    kept = _nnx_step(strategy, donate=False).lower(model, opt, x).compile().as_text()
    assert _aliased_parameters(kept) == set()


# ----------------------------------------------------- in a subprocess (no crash)

_REUSE = textwrap.dedent(
    """
    import json, os
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import jaxdist as jd

    s = jd.MirroredStrategy()
    x = jd.PerReplica(np.ones((8, 3), np.float32))
    out = {"devices": len(jax.devices())}

    @jd.train_step(s)
    def state_step(ctx, state, x):
        g = ctx.all_reduce("mean", jax.grad(lambda p: jnp.sum(p["w"] * x))(state.params))
        return state.apply_gradients(grads=g), ctx.all_reduce("sum", jnp.sum(x))

    with s.scope():
        state = jd.TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)}, tx=optax.sgd(1.0))
    new, loss = state_step(state, x)
    try:
        jax.block_until_ready(state_step(state, x))
        out["state"] = "no error"
    except RuntimeError as e:
        out["state"] = str(e)
    new, loss = state_step(new, x)
    out["state_after"] = np.asarray(new.params["w"]).tolist()

    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @jd.train_step(s)
    def nnx_step(ctx, model, opt, x):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, ctx.all_reduce("mean", g))
        return ctx.all_reduce("mean", loss)

    nnx_step(model, opt, x)
    saved = jax.tree.map(lambda a: a, nnx.state(model))
    nnx_step(model, opt, x)
    nnx.update(model, saved)
    try:
        jax.block_until_ready(nnx_step(model, opt, x))
        out["nnx"] = "no error"
    except RuntimeError as e:
        out["nnx"] = str(e)
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(240)
def test_reused_donated_state_raises_in_a_fresh_process() -> None:
    out = run_python(_REUSE)
    assert out["devices"] == 8
    assert re.search(r"argument `state` \(args\[0\], TrainState\) " + DONATED, out["state"])
    np.testing.assert_allclose(out["state_after"], np.full(3, -2.0), rtol=RTOL)  # 2 sgd steps
    assert re.search(r"argument `model` \(args\[0\], Linear\) " + DONATED, out["nnx"])


_REUSE_RUN_OPTIONS = """
import json
import jax, jax.numpy as jnp, numpy as np
import jaxdist as jd

s = jd.MirroredStrategy()
f = s.function(lambda ctx, a: ctx.all_reduce("sum", a) + a,
               options=jd.RunOptions(donate_args=True))
x = jax.device_put(jnp.arange(4.0), s.replicated_sharding)
y = f(x)
out = {"deleted": bool(x.is_deleted())}
try:
    f(x)
    out["error"] = None
except RuntimeError as e:
    out["error"] = str(e)
z = f(y)  # the returned value works
ref = np.arange(4.0) * 9
out["ok"] = bool(np.allclose(np.asarray(z.array if hasattr(z, "array") else z), ref * 9))
print(json.dumps(out))
"""


def test_run_options_donated_argument_passed_again_raises() -> None:
    """``RunOptions(donate_args=True)``: an argument donated to an earlier call and passed
    again raises (jax 0.10 crashes with a segmentation fault otherwise); checked in a fresh
    process so a regression fails one test."""
    out = run_python(_REUSE_RUN_OPTIONS)
    assert out["deleted"] is True
    assert out["error"] is not None and re.search(
        r"MirroredStrategy\.run\(<lambda>\): args\[0\] was donated to an earlier call "
        r"\(RunOptions\(donate_args=True\)",
        out["error"],
    ), out["error"]
    assert out["ok"] is True
