"""accumulate_gradients: micro-batches summed in one scan, reduced across replicas once."""

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
from jaxdist.training.step.accumulate import accumulate_gradients
from jaxdist.training.step.losses import compute_average_loss, scale_regularization_loss

from _helpers import regression_data, value

RTOL = 1e-5


def _mlp_params() -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (5, 16)) / np.sqrt(5),
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 1)) / 4.0,
        "b2": jnp.full((1,), 0.3),
    }


def _per_example(params: Any, x: Any, y: Any) -> Any:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] + params["b2"])[:, 0] - y) ** 2


def _loss_fn(params: Any, batch: Any) -> Any:
    return compute_average_loss(_per_example(params, *batch))


def _data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    return regression_data(rows, 5, seed=1)


def _first_batch(strategy: jd.Strategy, x: np.ndarray, y: np.ndarray, batch_size: int) -> Any:
    """The first global batch of ``(x, y)``, distributed by ``strategy``."""
    data = jd.data.from_arrays(x, y, batch_size=batch_size)
    return next(iter(strategy.experimental_distribute_dataset(data)))


def _plain(tree: Any) -> Any:
    """``tree`` with run outputs (`Mirrored`, `PerReplica`) replaced by their arrays."""
    is_dv = lambda x: isinstance(x, jd.DistributedValues)  # noqa: E731
    return jax.tree.map(lambda x: x.array if is_dv(x) else x, tree, is_leaf=is_dv)


def _host(x: Any) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _assert_tree_close(actual: Any, expected: Any, rtol: float = RTOL) -> None:
    """Same structure and values (run outputs unwrapped)."""
    a_leaves, a_def = jax.tree.flatten(_plain(actual))
    e_leaves, e_def = jax.tree.flatten(_plain(expected))
    assert a_def == e_def
    for a, e in zip(a_leaves, e_leaves, strict=True):
        np.testing.assert_allclose(_host(a), _host(e), rtol=rtol, atol=1e-6)


def _steps(strategy: jd.Strategy, steps: int | None) -> Any:
    """A step function: loss and gradients, accumulated over ``steps`` or in one go,
    all-reduced once."""

    def step(ctx: jd.ReplicaContext, params: Any, batch: Any) -> Any:
        if steps is None:
            loss, grads = jax.value_and_grad(_loss_fn)(params, batch)
        else:
            loss, grads = accumulate_gradients(_loss_fn, params, batch, steps)
        return ctx.all_reduce("sum", (loss, grads))

    return strategy.function(step)


# Equal to the whole batch ---------------------------------------------------------


def test_four_micro_batches_equal_one_batch_on_8_replicas() -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data(64)
    params = _mlp_params()
    batch = _first_batch(strategy, x, y, 64)
    whole_loss, whole_grads = _steps(strategy, None)(params, batch)
    loss, grads = _steps(strategy, 4)(params, batch)
    np.testing.assert_allclose(value(loss), value(whole_loss), rtol=RTOL)
    _assert_tree_close(grads, whole_grads)
    # ... and both equal single-device training on the global batch.
    ref_loss, ref_grads = jax.value_and_grad(lambda p: jnp.mean(_per_example(p, x, y)))(params)
    np.testing.assert_allclose(value(loss), ref_loss, rtol=RTOL)
    _assert_tree_close(grads, ref_grads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make",
    [jd.MirroredStrategy, lambda: jd.MirroredStrategy(jax.devices()[:2]), jd.OneDeviceStrategy],
)
def test_padded_partial_batch_is_masked_per_micro_batch(make: Any) -> None:
    # 100 rows at 64: the last batch has 36 rows, padded; with 8 replicas each has
    # 8 rows of which 5 (the last replica: 1) are data, so micro-batches of 2 rows
    # are whole, partial or all padding.
    strategy = make()
    x, y = _data(100)
    params = _mlp_params()
    dataset = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=64))
    run = _steps(strategy, 4)
    for (lo, hi), batch in zip([(0, 64), (64, 100)], dataset, strict=True):
        loss, grads = run(params, batch)
        ref_loss, ref_grads = jax.value_and_grad(
            lambda p: jnp.mean(_per_example(p, x[lo:hi], y[lo:hi]))  # noqa: B023
        )(params)
        np.testing.assert_allclose(value(loss), ref_loss, rtol=RTOL)
        _assert_tree_close(grads, ref_grads)


def test_without_strategy_and_with_aux() -> None:
    x, y = _data(12)
    params = _mlp_params()

    def loss_fn(p: Any, batch: Any) -> Any:
        per_example = _per_example(p, *batch)
        return compute_average_loss(per_example), per_example

    (loss, aux), grads = accumulate_gradients(loss_fn, params, (x, y), 3, has_aux=True)
    (ref_loss, ref_aux), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, (x, y))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _assert_tree_close(grads, ref_grads)
    assert aux.shape == (3, 4)  # stacked over micro-batches
    np.testing.assert_allclose(aux.reshape(-1), ref_aux, rtol=RTOL)


def test_nested_accumulation_still_divides_by_the_whole_batch() -> None:
    x, y = _data(16)
    params = _mlp_params()

    def outer(p: Any, batch: Any) -> Any:
        return accumulate_gradients(_loss_fn, p, batch, 2)[0]

    loss, grads = accumulate_gradients(outer, params, (x, y), 2)
    ref_loss, ref_grads = jax.value_and_grad(_loss_fn)(params, (x, y))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _assert_tree_close(grads, ref_grads)


def test_regularization_is_counted_once_over_micro_batches_and_replicas() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    x, y = _data(16)
    params = _mlp_params()

    def loss_fn(p: Any, batch: Any) -> Any:
        return _loss_fn(p, batch) + scale_regularization_loss(jnp.sum(p["w1"] ** 2))

    def step(ctx: jd.ReplicaContext, p: Any, batch: Any) -> Any:
        return ctx.all_reduce("sum", accumulate_gradients(loss_fn, p, batch, 4))

    batch = _first_batch(strategy, x, y, 16)
    loss, grads = strategy.run(step, args=(params, batch))
    ref_loss, ref_grads = jax.value_and_grad(
        lambda p: jnp.mean(_per_example(p, x, y)) + jnp.sum(p["w1"] ** 2)
    )(params)
    np.testing.assert_allclose(value(loss), ref_loss, rtol=RTOL)
    _assert_tree_close(grads, ref_grads)


def test_dtypes_are_kept() -> None:
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _mlp_params())
    x, y = _data(8)
    loss, grads = accumulate_gradients(_loss_fn, params, (x, y), 4)
    assert loss.dtype == jnp.float32  # the loss of float32 data
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    ref = jax.grad(_loss_fn)(jax.tree.map(lambda p: p.astype(jnp.float32), params), (x, y))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        # bfloat16 keeps 8 bits of mantissa: within 1% of the largest entry.
        assert np.abs(np.asarray(g, np.float32) - r).max() <= 1e-2 * np.abs(r).max()


# One all-reduce per step, none inside the loop -------------------------------------

_CALLEE = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^,}\s]+)")


def _computations(hlo: str) -> dict[str, str]:
    """HLO module text split into computations, by name."""
    out: dict[str, str] = {}
    for block in re.split(r"\n(?=\S)", hlo):
        head = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", block)
        if head and "{" in block.split("\n", 1)[0]:
            out[head.group(1)] = block
    return out


def _reachable(comps: dict[str, str], root: str) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for group in _CALLEE.findall(comps[name]):
            todo.extend(n.lstrip("%") for n in group.split(","))
    return seen


def _all_reduces(text: str) -> int:
    return len(re.findall(r"\ball-reduce(?:-start)?\(", text))


def test_hlo_reduces_once_per_step_and_never_inside_the_loop() -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data(64)
    params = _mlp_params()
    batch = _first_batch(strategy, x, y, 64)
    plain = _steps(strategy, None).lower(params, batch).compile().as_text()
    accumulated = _steps(strategy, 4).lower(params, batch).compile().as_text()
    assert _all_reduces(plain) > 0
    assert _all_reduces(accumulated) == _all_reduces(plain)
    comps = _computations(accumulated)
    bodies = re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", accumulated)
    assert bodies, "the micro-batch loop should compile to an HLO while loop"
    for body in bodies:
        inside = _reachable(comps, body)
        assert inside, body
        assert not any(_all_reduces(comps[name]) for name in inside)


# Flax NNX -------------------------------------------------------------------------


class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, dropout: float = 0.0, batch_norm: bool = False):
        self.l1 = nnx.Linear(5, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs) if batch_norm else None
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.tanh(self.l1(x))
        if self.bn is not None:
            h = self.bn(h)
        return self.l2(self.drop(h))[:, 0]


def _nnx_loss(model: _MLP, batch: Any) -> Any:
    x, y = batch
    return compute_average_loss((model(x) - y) ** 2)


def test_nnx_module_matches_nnx_value_and_grad_on_8_replicas() -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data(64)
    model = _MLP(nnx.Rngs(0))
    batch = _first_batch(strategy, x, y, 64)

    @jd.train_step(strategy, donate=False)
    def step(ctx: jd.ReplicaContext, model: _MLP, batch: Any) -> Any:
        whole = nnx.value_and_grad(lambda m: _nnx_loss(m, batch))(model)
        accumulated = accumulate_gradients(_nnx_loss, model, batch, 4)
        return ctx.all_reduce("sum", (whole, accumulated))

    (loss, grads), (acc_loss, acc_grads) = step(model, batch)
    assert isinstance(acc_grads, nnx.State)
    assert jax.tree.structure(acc_grads) == jax.tree.structure(grads)
    np.testing.assert_allclose(acc_loss, loss, rtol=RTOL)
    _assert_tree_close(acc_grads, grads)
    ref_loss, ref_grads = nnx.value_and_grad(lambda m: _nnx_loss(m, (x, y)))(model)
    np.testing.assert_allclose(acc_loss, ref_loss, rtol=RTOL)
    _assert_tree_close(acc_grads, ref_grads)


def test_nnx_training_with_accumulation_tracks_plain_training() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    # 40 rows at 16: the last batch has 8 rows, 4 per replica, so its second
    # micro-batch on each replica is all padding.
    x, y = _data(40)
    models = [_MLP(nnx.Rngs(0)) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    data = jd.data.from_arrays(x, y, batch_size=16)

    @jd.train_step(strategy)
    def step(ctx: jd.ReplicaContext, model: _MLP, opt: nnx.Optimizer, batch: Any) -> Any:
        loss, grads = accumulate_gradients(_nnx_loss, model, batch, 2)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    @jd.train_step(strategy)
    def plain(ctx: jd.ReplicaContext, model: _MLP, opt: nnx.Optimizer, batch: Any) -> Any:
        loss, grads = nnx.value_and_grad(lambda m: _nnx_loss(m, batch))(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    for _ in range(3):
        for batch in strategy.experimental_distribute_dataset(data):
            a = step(models[0], opts[0], batch)
            b = plain(models[1], opts[1], batch)
            np.testing.assert_allclose(a, b, rtol=RTOL)
    _assert_tree_close(nnx.state(models[0], nnx.Param), nnx.state(models[1], nnx.Param))


def test_nnx_state_carries_from_micro_batch_to_micro_batch() -> None:
    x, y = _data(8)
    model = _MLP(nnx.Rngs(0), dropout=0.5, batch_norm=True)
    twin = nnx.clone(model)
    accumulate_gradients(_nnx_loss, model, (x, y), 2)
    # The reference: the same two micro-batches, one after the other.
    twin(x[:4])
    twin(x[4:])
    _assert_tree_close(nnx.state(model, nnx.BatchStat), nnx.state(twin, nnx.BatchStat))
    _assert_tree_close(nnx.state(model, nnx.RngState), nnx.state(twin, nnx.RngState))
    assert not np.allclose(nnx.state(model, nnx.BatchStat)["bn"]["mean"][...], 0.0)


def test_nnx_wrt_filter() -> None:
    x, y = _data(8)
    model = _MLP(nnx.Rngs(0))
    only_l2 = nnx.All(nnx.Param, nnx.PathContains("l2"))
    _, grads = accumulate_gradients(_nnx_loss, model, (x, y), 2, wrt=only_l2)
    _, ref = nnx.value_and_grad(lambda m: _nnx_loss(m, (x, y)), argnums=nnx.DiffState(0, only_l2))(
        model
    )
    assert set(grads.keys()) == {"l2"}
    _assert_tree_close(grads, ref)


def test_hlo_of_a_train_step_with_an_optimizer_reduces_once() -> None:
    """The whole compiled `jd.train_step` (adamw update included): the same all-reduces with
    4 micro-batches as without, one while loop for them, no all-reduce inside it."""
    strategy = jd.MirroredStrategy()
    x, y = _data(64)
    batch = _first_batch(strategy, x, y, 64)
    tx = optax.adamw(1e-3)

    def build(steps: int | None) -> Any:
        @jd.train_step(strategy)
        def step(ctx: jd.ReplicaContext, model: _MLP, opt: nnx.Optimizer, batch: Any) -> Any:
            if steps is None:
                loss, grads = nnx.value_and_grad(_nnx_loss)(model, batch)
            else:
                loss, grads = accumulate_gradients(_nnx_loss, model, batch, steps)
            opt.update(model, ctx.all_reduce("sum", grads))
            return ctx.all_reduce("sum", loss)

        return step

    texts = {}
    for steps in (None, 4):
        with strategy.scope():
            model = _MLP(nnx.Rngs(0))
            opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        texts[steps] = build(steps).lower(model, opt, batch).compile().as_text()
    plain, accumulated = texts[None], texts[4]
    assert _all_reduces(plain) > 0
    assert _all_reduces(accumulated) == _all_reduces(plain)
    assert "while(" not in plain
    bodies = re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", accumulated)
    assert len(bodies) == 1
    comps = _computations(accumulated)
    assert not any(_all_reduces(comps[name]) for name in _reachable(comps, bodies[0]))


# Errors ---------------------------------------------------------------------------


def test_batch_not_divisible_names_the_leaf() -> None:
    x, y = _data(10)
    with pytest.raises(
        ValueError,
        match=r"accumulate_gradients: batch\[0\] of shape \(10, 5\) has 10 rows, which do not "
        r"split into steps=4 equal micro-batches\. Use steps in \[1, 2, 5, 10\]",
    ):
        accumulate_gradients(_loss_fn, _mlp_params(), (x, y), 4)


@pytest.mark.parametrize("steps", [0, -2, 2.0, True, None])
def test_bad_steps(steps: Any) -> None:
    with pytest.raises(ValueError, match=r"accumulate_gradients: steps must be an int >= 1"):
        accumulate_gradients(_loss_fn, _mlp_params(), _data(8), steps)


def test_batch_leaves_must_share_rows() -> None:
    x, y = _data(8)
    with pytest.raises(
        ValueError,
        match=r"accumulate_gradients: the leaves of batch have different leading \(example\) "
        r"axes \{'batch\[0\]': 8, 'batch\[1\]': 6\}",
    ):
        accumulate_gradients(_loss_fn, _mlp_params(), (x, y[:6]), 2)
    with pytest.raises(ValueError, match=r"accumulate_gradients: batch\['lr'\] is a scalar"):
        accumulate_gradients(lambda p, b: 0.0, _mlp_params(), {"x": x, "lr": 0.1}, 2)
    with pytest.raises(ValueError, match=r"accumulate_gradients: batch has no array leaves"):
        accumulate_gradients(lambda p, b: 0.0, _mlp_params(), {}, 2)


def test_loss_must_be_scalar() -> None:
    with pytest.raises(TypeError, match=r"Gradient only defined for scalar-output functions"):
        accumulate_gradients(lambda p, b: _per_example(p, *b), _mlp_params(), _data(8), 2)


def test_wrt_needs_an_nnx_module() -> None:
    with pytest.raises(TypeError, match=r"wrt= filters the variables of a Flax NNX module"):
        accumulate_gradients(_loss_fn, _mlp_params(), _data(8), 2, wrt=nnx.Param)


def test_per_token_loss_with_padding_is_refused() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    x, y = _data(12)
    batch = list(strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=8)))[
        -1
    ]

    def loss_fn(p: Any, b: Any) -> Any:
        return compute_average_loss(jnp.repeat(_per_example(p, *b), 3))  # 3 "tokens" a row

    with pytest.raises(
        ValueError,
        match=r"compute_average_loss: per_example_loss of shape \(6,\) has 6 rows, but the "
        r"micro-batch of jaxdist.accumulate_gradients has 2",
    ):
        strategy.run(
            lambda ctx, p, b: accumulate_gradients(loss_fn, p, b, 2), args=(_mlp_params(), batch)
        )
