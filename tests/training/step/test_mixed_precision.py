"""Mixed precision: bfloat16 compute over float32 weights, and dynamic loss scaling."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd
from jaxdist.training.step.losses import compute_average_loss
from jaxdist.training.step.mixed_precision import DynamicLossScale, all_finite, select_tree

from _helpers import value

# A small classification task: 256 examples of 16 features, labels from a random
# linear teacher, so the loss falls steadily.
_ROWS, _FEATURES, _CLASSES = 256, 16, 4


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(_ROWS, _FEATURES)).astype(np.float32)
    teacher = rng.normal(size=(_FEATURES, _CLASSES))
    return x, np.argmax(x @ teacher, axis=-1).astype(np.int32)


class _MLP(nnx.Module):
    def __init__(self, dtype: Any, rngs: nnx.Rngs) -> None:
        kw = {"dtype": dtype, "param_dtype": jnp.float32, "rngs": rngs}
        self.l1 = nnx.Linear(_FEATURES, 64, **kw)
        self.l2 = nnx.Linear(64, 64, **kw)
        self.l3 = nnx.Linear(64, _CLASSES, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def _per_example(model: _MLP, x: Any, y: Any) -> Any:
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _params(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]


# bfloat16 compute, float32 master weights (no library code) -------------------------


def _train_plain(dtype: Any, epochs: int) -> tuple[list[float], nnx.Module]:
    strategy = jd.MirroredStrategy()
    model = _MLP(dtype, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    @jd.train_step(strategy)
    def step(ctx: jd.ReplicaContext, model: _MLP, opt: nnx.Optimizer, batch: Any) -> Any:
        x, y = batch

        def loss_fn(m: _MLP) -> Any:
            return compute_average_loss(_per_example(m, x, y))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    x, y = _data()
    data = jd.data.from_arrays(x, y, batch_size=64)
    losses = []
    for _ in range(epochs):
        for batch in strategy.experimental_distribute_dataset(data):
            losses.append(float(step(model, opt, batch)))
    return losses, model


@pytest.mark.timeout(180)
def test_bfloat16_compute_tracks_float32_and_keeps_float32_weights() -> None:
    reference, _ = _train_plain(jnp.float32, epochs=3)
    losses, model = _train_plain(jnp.bfloat16, epochs=3)
    assert all(p.dtype == np.float32 for p in _params(model))  # master weights after updates
    assert model.l1.kernel.get_raw_value().sharding.is_fully_replicated
    assert model(jnp.ones((2, _FEATURES))).dtype == jnp.bfloat16
    assert losses[-1] < 0.6 * losses[0]  # it trains
    # bfloat16 rounds activations to 8 bits of mantissa (relative error 2**-9 per op);
    # over 12 SGD steps the loss was measured within 0.5% of float32's (max relative
    # gap 0.0044 on this task). 2% leaves room for other CPUs' reduction orders.
    np.testing.assert_allclose(losses, reference, rtol=2e-2)


# DynamicLossScale -----------------------------------------------------------------


def test_overflow_halves_and_resets_the_counter() -> None:
    ls = DynamicLossScale(loss_scale=1024.0, period=3)
    ls = ls.update(True)
    assert int(ls.counter) == 1
    ls = ls.update(jnp.bool_(False))
    assert float(ls.loss_scale) == 512.0
    assert int(ls.counter) == 0


def test_growth_after_period_finite_steps() -> None:
    ls = DynamicLossScale(loss_scale=4.0, period=3, factor=4.0)
    for expected_counter in (1, 2):
        ls = ls.update(True)
        assert float(ls.loss_scale) == 4.0
        assert int(ls.counter) == expected_counter
    ls = ls.update(True)
    assert float(ls.loss_scale) == 16.0
    assert int(ls.counter) == 0


def test_scale_stays_within_min_scale_and_float32() -> None:
    ls = DynamicLossScale(loss_scale=2.0, min_scale=1.5)
    assert float(ls.update(False).loss_scale) == 1.5
    assert float(ls.update(False).update(False).loss_scale) == 1.5
    big = DynamicLossScale(loss_scale=2.0**127, period=1)
    assert float(big.update(True).loss_scale) == 2.0**127  # 2**128 would be inf


def test_is_an_immutable_pytree_through_jit() -> None:
    ls = DynamicLossScale(period=5)
    leaves = jax.tree.leaves(ls)
    assert [x.dtype for x in leaves] == [jnp.float32, jnp.int32]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    assert paths == [".loss_scale", ".counter"]
    out = jax.jit(lambda s: s.update(jnp.bool_(False)))(ls)
    assert isinstance(out, DynamicLossScale)
    assert (out.period, out.factor, out.min_scale) == (5, 2.0, 1.0)
    assert float(out.loss_scale) == 2.0**14
    with pytest.raises(AttributeError, match=r"DynamicLossScale is immutable; loss_scale"):
        ls.loss_scale = jnp.float32(1.0)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"period": 0}, r"DynamicLossScale: period must be an int >= 1 \(finite steps .*\), got 0"),
        ({"period": 2.5}, r"period must be an int >= 1"),
        ({"factor": 1.0}, r"DynamicLossScale: factor must be a finite number > 1 .* got 1\.0"),
        ({"min_scale": 0.0}, r"DynamicLossScale: min_scale must be a finite number > 0, got 0"),
        ({"loss_scale": 0.5}, r"loss_scale must be a finite scalar >= min_scale=1\.0, got 0\.5"),
        ({"loss_scale": float("inf")}, r"loss_scale must be a finite scalar"),
        ({"loss_scale": [2.0, 4.0]}, r"loss_scale must be a finite scalar"),
    ],
)
def test_invalid_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DynamicLossScale(**kwargs)


def test_scale_and_unscale_dtypes() -> None:
    ls = DynamicLossScale(loss_scale=2.0**15)
    scaled = ls.scale(jnp.float16(3.0))
    assert scaled.dtype == jnp.float32  # 3 * 2**15 overflows float16; float32 does not
    assert float(scaled) == 3.0 * 2**15
    grads = {"w": jnp.full((2,), 2.0**16, jnp.float32), "h": jnp.full((2,), 2.0**10, jnp.float16)}
    out = ls.unscale(grads)
    assert out["w"].dtype == jnp.float32 and out["h"].dtype == jnp.float16
    np.testing.assert_array_equal(out["w"], 2.0)
    np.testing.assert_array_equal(np.asarray(out["h"], np.float32), 2.0**-5)
    with pytest.raises(TypeError, match=r"DynamicLossScale.unscale: leaf \['n'\] has dtype int32"):
        ls.unscale({"n": jnp.int32(1)})
    with pytest.raises(ValueError, match=r"update: grads_finite must be a boolean scalar"):
        ls.update(jnp.ones(3, bool))


def test_all_finite_and_select_tree() -> None:
    tree = {"w": jnp.ones(3), "n": jnp.int32(7), "h": jnp.ones(2, jnp.float16)}
    assert bool(all_finite(tree))
    assert not bool(all_finite({**tree, "h": jnp.array([1.0, jnp.nan], jnp.float16)}))
    assert not bool(all_finite({**tree, "w": jnp.array([1.0, -jnp.inf, 0.0])}))
    assert bool(all_finite({}))
    old = {"w": jnp.zeros(2), "key": jax.random.key(0)}
    new = {"w": jnp.ones(2), "key": jax.random.key(1)}
    kept = select_tree(jnp.bool_(False), new, old)
    np.testing.assert_array_equal(kept["w"], 0.0)
    assert jnp.array_equal(jax.random.key_data(kept["key"]), jax.random.key_data(old["key"]))
    np.testing.assert_array_equal(select_tree(True, new, old)["w"], 1.0)


def test_select_tree_errors() -> None:
    with pytest.raises(ValueError, match=r"select_tree: pred must be a boolean scalar .* \(2,\)"):
        select_tree(jnp.ones(2, bool), {"w": 1.0}, {"w": 2.0})
    with pytest.raises(ValueError, match=r"select_tree: on_true and on_false must have the same"):
        select_tree(True, {"w": 1.0}, {"v": 2.0})
    with pytest.raises(
        ValueError, match=r"select_tree: leaf \['w'\] is float32\[2\] in on_true but float32\[3\]"
    ):
        select_tree(True, {"w": jnp.ones(2)}, {"w": jnp.ones(3)})


# Agreement across replicas --------------------------------------------------------


def test_all_finite_agrees_across_replicas() -> None:
    strategy = jd.MirroredStrategy()
    rows = np.ones((8, 3), np.float32)
    rows[3, 1] = np.inf  # one replica overflows

    def fn(ctx: jd.ReplicaContext, x: Any) -> Any:
        return all_finite(x), all_finite(ctx.all_reduce("sum", x)), jnp.all(jnp.isfinite(x))

    agreed, after_reduce, local = strategy.run(fn, args=(jd.PerReplica(jnp.asarray(rows)),))
    assert isinstance(agreed, jd.Mirrored) and not bool(value(agreed))
    assert isinstance(after_reduce, jd.Mirrored) and not bool(value(after_reduce))
    assert value(local).tolist() == [True, True, True, False, True, True, True, True]


def _count_all_reduces(strategy: jd.Strategy, fn: Any, *args: Any) -> int:
    text = strategy.function(fn).lower(*args).compile().as_text()
    return len(re.findall(r"\ball-reduce(?:-start)?\(", text))


def test_checking_after_the_all_reduce_costs_no_collective() -> None:
    strategy = jd.MirroredStrategy()
    x = jd.PerReplica(jnp.ones((8, 4)))

    def reduce_only(ctx: jd.ReplicaContext, x: Any) -> Any:
        return ctx.all_reduce("sum", x)

    def check_after(ctx: jd.ReplicaContext, x: Any) -> Any:
        g = ctx.all_reduce("sum", x)
        return g, all_finite(g)

    def check_before(ctx: jd.ReplicaContext, x: Any) -> Any:
        return ctx.all_reduce("sum", x), all_finite(x)

    base = _count_all_reduces(strategy, reduce_only, x)
    assert _count_all_reduces(strategy, check_after, x) == base
    assert _count_all_reduces(strategy, check_before, x) == base + 1


# Loss scaling in a train step -----------------------------------------------------


def _scaled_step(strategy: jd.Strategy, check: str = "after") -> Any:
    """The documented loss-scaled step; ``check="before"`` tests each replica's own gradients
    before the all-reduce (`all_finite` then all-reduces the decision)."""

    @jd.train_step(strategy)
    def step(
        ctx: jd.ReplicaContext,
        model: _MLP,
        opt: nnx.Optimizer,
        loss_scale: DynamicLossScale,
        batch: Any,
    ) -> Any:
        x, y = batch

        def loss_fn(m: _MLP) -> Any:
            loss = compute_average_loss(_per_example(m, x, y))
            return loss_scale.scale(loss), loss

        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        grads = loss_scale.unscale(grads)
        if check == "before":
            finite = all_finite(grads)
            grads = ctx.all_reduce("sum", grads)
        else:
            grads = ctx.all_reduce("sum", grads)
            finite = all_finite(grads)
        old = jax.tree.map(lambda v: v, nnx.state((model, opt)))  # a snapshot
        opt.update(model, grads)
        nnx.update((model, opt), select_tree(finite, nnx.state((model, opt)), old))
        return loss_scale.update(finite), ctx.all_reduce("sum", loss)

    return step


def _distributed(strategy: jd.Strategy, x: np.ndarray, y: np.ndarray, batch: int) -> Any:
    return strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=batch))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", ["after", "before"])
def test_overflow_skips_the_update_and_halves_the_scale(check: str) -> None:
    strategy = jd.MirroredStrategy()
    model = _MLP(jnp.float16, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = _scaled_step(strategy, check)
    ls = DynamicLossScale(loss_scale=2.0**10, period=2)
    x, y = _data()
    x, y = x[:64], y[:64]
    clean = next(iter(_distributed(strategy, x, y, 64)))
    # A new array, not x changed in place: on CPU a batch may share memory with its source.
    bad = x.copy()
    bad[21, 0] = np.inf  # one example, on replica 2 of 8, overflows
    poisoned = next(iter(_distributed(strategy, bad, y, 64)))

    before, opt_before = _params(model), [np.asarray(a) for a in jax.tree.leaves(nnx.state(opt))]
    ls, _ = step(model, opt, ls, poisoned)
    # One decision for all replicas: the scale comes back as one replicated copy.
    assert isinstance(ls.loss_scale, jax.Array) and ls.loss_scale.sharding.is_fully_replicated
    assert float(ls.loss_scale) == 2.0**9 and int(ls.counter) == 0
    for a, b in zip(_params(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(nnx.state(opt)), opt_before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # the step count and moments too

    ls, _ = step(model, opt, ls, clean)
    assert float(ls.loss_scale) == 2.0**9 and int(ls.counter) == 1
    assert all(np.isfinite(p).all() for p in _params(model))
    assert any(not np.array_equal(a, b) for a, b in zip(_params(model), before, strict=True))
    ls, _ = step(model, opt, ls, clean)
    assert float(ls.loss_scale) == 2.0**10 and int(ls.counter) == 0  # period 2: grown
    assert isinstance(ls.loss_scale, jax.Array)  # one replicated copy, not PerReplica


def _train_scaled(
    dtype: Any, epochs: int, loss_scale: float = 2.0**15
) -> tuple[list[float], DynamicLossScale, nnx.Module]:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model = _MLP(dtype, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    step = _scaled_step(strategy)
    ls = DynamicLossScale(loss_scale=loss_scale)
    x, y = _data()
    losses = []
    for _ in range(epochs):
        for batch in _distributed(strategy, x, y, 64):
            ls, loss = step(model, opt, ls, batch)
            losses.append(float(loss))
    return losses, ls, model


@pytest.mark.timeout(180)
def test_float16_training_with_loss_scaling_tracks_float32() -> None:
    reference, _, _ = _train_scaled(jnp.float32, epochs=3)
    losses, ls, _ = _train_scaled(jnp.float16, epochs=3)
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**15, 12)  # no step was skipped
    assert losses[-1] < 0.6 * losses[0]
    # float16 keeps 11 bits of mantissa; the loss was measured within 0.06% of float32's
    # (max relative gap 0.00051 over 12 steps). 1% leaves room for other CPUs.
    np.testing.assert_allclose(losses, reference, rtol=1e-2)


@pytest.mark.timeout(120)
def test_float16_training_from_a_scale_too_large_backs_off() -> None:
    # At 2**24 the scaled cotangents of the logits overflow float16: those steps are
    # skipped and the scale halves until it fits, then training proceeds.
    losses, ls, model = _train_scaled(jnp.float16, epochs=3, loss_scale=2.0**24)
    assert 1.0 <= float(ls.loss_scale) < 2.0**24
    assert int(ls.counter) < 12
    assert all(np.isfinite(p).all() for p in _params(model))
    assert losses[-1] < 0.9 * losses[0]  # measured: 1.47 -> 1.23 (7 of 12 steps skipped)


def test_loss_scaling_rescues_float16_gradients_that_underflow() -> None:
    model = _MLP(jnp.float16, nnx.Rngs(0))
    x, y = _data()
    tiny = 2.0**-24  # a loss this small has float16 cotangents below the subnormals

    def grads_of(factor: float, ls: DynamicLossScale | None) -> dict[str, np.ndarray]:
        def loss_fn(m: _MLP) -> Any:
            loss = compute_average_loss(_per_example(m, x, y)) * factor
            return loss if ls is None else ls.scale(loss)

        g = nnx.grad(loss_fn)(model)
        g = g if ls is None else ls.unscale(g)
        flat = nnx.to_flat_state(g)
        return {".".join(map(str, k)): np.asarray(v[...], np.float64) / factor for k, v in flat}

    reference = grads_of(1.0, None)  # the same float16 model on a loss of normal size
    unscaled = grads_of(tiny, None)
    scaled = grads_of(tiny, DynamicLossScale(loss_scale=2.0**24))
    kernel = unscaled["l1.kernel"]  # its cotangents pass through float16 activations
    assert np.count_nonzero(kernel) < 0.1 * kernel.size
    for name, r in reference.items():
        np.testing.assert_allclose(scaled[name], r, rtol=0, atol=1e-3 * np.abs(r).max())
