"""`MeshStrategy` with the state forms other than NNX modules, `fit`, checkpoints, creation.

References: the same computation on one device (``jax.jit`` and optax, or
`MirroredStrategy` where the reference is jaxdist's own data parallelism, which
the other tests hold to one device); rtol 1e-5, atol 1e-6 (adamw ``eps=1e-5``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist.examples.gpt import RULES, Decoder, mesh_strategy

from _helpers import per_device_bytes, ruled_share, total_bytes

pytestmark = pytest.mark.timeout(300)

RTOL, ATOL = 1e-5, 1e-6
BATCH, FEATURES = 16, 32


def _data(steps: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, BATCH, FEATURES)).astype(np.float32)
    return x, np.tanh(x @ rng.normal(size=(FEATURES, FEATURES)).astype(np.float32))


def _split(strategy: jd.Strategy, x: np.ndarray, y: np.ndarray) -> tuple:
    n = strategy.num_replicas_in_sync
    xs, ys = x.reshape(n, -1, FEATURES), y.reshape(n, -1, FEATURES)
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: (xs[ctx.replica_id_in_sync_group], ys[ctx.replica_id_in_sync_group])
    )


def _state_step(strategy: jd.Strategy, apply: object) -> jd.TrainStep:
    @jd.train_step(strategy)
    def step(ctx, state, x, y):  # type: ignore[no-untyped-def]
        def loss(p):  # type: ignore[no-untyped-def]
            per_example = jnp.mean((apply(p, x) - y) ** 2, axis=-1)
            return jd.compute_average_loss(per_example, global_batch_size=BATCH)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=ctx.all_reduce("sum", grads)), ctx.all_reduce(
            "sum", value
        )

    return step


def _one_device(apply: object, params: object, steps: int = 5) -> tuple[list[float], object]:
    tx = optax.adamw(3e-3, eps=1e-5)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):  # type: ignore[no-untyped-def]
        value, grads = jax.value_and_grad(lambda p: jnp.mean((apply(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for x, y in zip(*_data(steps), strict=True):
        params, opt_state, value = step(params, opt_state, x, y)
        losses.append(float(value))
    return losses, params


def _assert_close(a: object, b: object) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


def _spec_of(array: jax.Array, strategy: jd.experimental.MeshStrategy, spec: P) -> bool:
    return array.sharding.is_equivalent_to(NamedSharding(strategy.mesh, spec), array.ndim)


# Linen boxes and param_rules in a TrainState ------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def dense(features: int, names: tuple[str, str]) -> nn.Dense:
            return nn.Dense(
                features,
                kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), names[1:]),
            )

        hidden = jnp.tanh(dense(128, ("embed", "mlp"))(x))
        return dense(FEATURES, ("mlp", "embed"))(hidden)


def test_a_linen_model_with_logical_partitioning_in_a_train_state() -> None:
    strategy = mesh_strategy((2, 2, 2))
    boxed = LinenMLP().init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]
    model = LinenMLP()
    state = jd.TrainState.create(apply_fn=model.apply, params=boxed, tx=optax.adamw(3e-3, eps=1e-5))
    layout = strategy.state_layout(state)
    assert layout["params/Dense_0/kernel"] == P("fsdp", "tensor")
    assert layout["params/Dense_1/kernel"] == P("tensor", "fsdp")
    assert layout["opt_state/0/mu/Dense_0/kernel"] == P("fsdp", "tensor")  # boxes kept by optax
    assert layout["step"] == P()

    def apply(p, x):  # type: ignore[no-untyped-def]
        return model.apply({"params": p}, x)

    step = _state_step(strategy, apply)
    losses = []
    for x, y in zip(*_data(), strict=True):
        state, value = step(state, *_split(strategy, x, y))
        losses.append(float(value))
    ref_losses, ref_params = _one_device(apply, nn.unbox(boxed))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    _assert_close(nn.unbox(state.params), ref_params)
    kernel = state.params["Dense_0"]["kernel"].value
    assert _spec_of(kernel, strategy, P("fsdp", "tensor"))
    mu = state.opt_state[0].mu["Dense_1"]["kernel"].value
    assert _spec_of(mu, strategy, P("tensor", "fsdp"))


def _plain_params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "up": {"w": jax.random.normal(k1, (FEATURES, 128)) / 6, "b": jnp.zeros((128,))},
        "down": {"w": jax.random.normal(k2, (128, FEATURES)) / 12, "b": jnp.zeros((FEATURES,))},
    }


def _plain_apply(p, x):  # type: ignore[no-untyped-def]
    return jnp.tanh(x @ p["up"]["w"] + p["up"]["b"]) @ p["down"]["w"] + p["down"]["b"]


def test_a_params_dict_is_laid_out_by_param_rules_and_trains_equal() -> None:
    strategy = mesh_strategy(
        (1, 4, 2),
        param_rules=(
            (r"^params/up/w$", ("embed", "mlp")),  # anchored: the moments follow it
            (r"down/w$", ("mlp", "embed")),
            (r"up/b$", ("mlp",)),
            (r"/b$", None),
        ),
        min_shard_bytes=0,
    )
    with strategy.scope():
        state = jd.TrainState.create(
            apply_fn=_plain_apply, params=_plain_params(), tx=optax.adamw(3e-3, eps=1e-5)
        )
    layout = strategy.state_layout(state)
    assert layout["params/up/w"] == P("fsdp", "tensor")
    assert layout["opt_state/0/nu/up/w"] == P("fsdp", "tensor")  # follows its parameter
    assert layout["opt_state/0/mu/down/w"] == P("tensor", "fsdp")
    assert layout["params/down/b"] == P()
    assert layout["opt_state/0/count"] == P()
    step = _state_step(strategy, _plain_apply)
    losses = []
    for x, y in zip(*_data(), strict=True):
        state, value = step(state, *_split(strategy, x, y))
        losses.append(float(value))
    ref_losses, ref_params = _one_device(_plain_apply, _plain_params())
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    _assert_close(state.params, ref_params)
    for path, spec in layout.items():
        if path.startswith("params/"):
            keys = path.split("/")[1:]
            assert _spec_of(state.params[keys[0]][keys[1]], strategy, spec), path


def test_an_unmatched_large_leaf_of_a_params_dict_is_an_error() -> None:
    strategy = mesh_strategy((2, 2, 2), param_rules=((r"up/w$", ("embed", "mlp")),))
    state = jd.TrainState.create(
        apply_fn=_plain_apply, params=_plain_params(), tx=optax.adamw(1e-3)
    )
    with pytest.raises(ValueError, match=r"params/down/w of shape \(128, 32\) \(16,384 bytes\)"):
        _state_step(strategy, _plain_apply)(state, *_split(strategy, *(a[0] for a in _data(1))))


# fit, steps_per_execution ---------------------------------------------------------


def test_fit_with_grouped_steps_trains_equal_to_mirrored() -> None:
    tokens = np.random.default_rng(0).integers(0, 64, size=(32, 9)).astype(np.int32)

    def run(strategy: jd.Strategy, eager: bool) -> tuple[list[float], Decoder]:
        with nnx.use_eager_sharding(eager), strategy.scope():
            model = Decoder(nnx.Rngs(0), layers=1)
            opt = nnx.Optimizer(model, optax.adamw(3e-3, eps=1e-5), wrt=nnx.Param)

        @jd.train_step(strategy, steps_per_execution=2)
        def step(ctx, model, opt, batch):  # type: ignore[no-untyped-def]
            x, y = batch

            def loss(m):  # type: ignore[no-untyped-def]
                xent = optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean(-1)
                return jd.compute_average_loss(xent, global_batch_size=16)

            value, grads = nnx.value_and_grad(loss)(model)
            opt.update(model, ctx.all_reduce("sum", grads))
            return {"loss": ctx.all_reduce("sum", value)}

        data = jd.data.from_arrays(tokens[:, :-1], tokens[:, 1:], batch_size=16)
        history = jd.fit(step, model, opt, data=data, epochs=2, verbose=False)
        return history.history["loss"], model

    mesh = mesh_strategy((2, 2, 2))
    got, model = run(mesh, True)
    want, ref = run(jd.MirroredStrategy(), False)
    assert len(got) == 2  # one mean loss per epoch of 2 steps (one grouped call)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    _assert_close(nnx.state(model), nnx.state(ref))
    assert _spec_of(model.blocks[0].up.kernel.get_value(), mesh, P("fsdp", "tensor"))


# Checkpoints across mesh shapes and strategies -----------------------------------------


def test_a_checkpoint_restores_across_meshes_and_strategies(tmp_path: object) -> None:
    """(2,2,2) -> (1,8,1) -> MirroredStrategy -> (2,2,2): every restore gives the saved
    values, in the restoring strategy's layout."""
    first = mesh_strategy((2, 2, 2))
    with first.scope():
        model = Decoder(nnx.Rngs(0), layers=1)
        opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    # Values that differ from a fresh model's: one step of training.
    tokens = np.random.default_rng(0).integers(0, 64, size=(16, 9)).astype(np.int32)
    step = _decoder_step(first)
    step(model, opt, *_token_split(first, tokens))
    saved = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    path = jd.checkpoint.Checkpoint(model=model).write(tmp_path / "ckpt")  # type: ignore[operator]

    def restore_into(strategy: jd.Strategy, eager: bool) -> Decoder:
        with nnx.use_eager_sharding(eager), strategy.scope():
            fresh = Decoder(nnx.Rngs(1), layers=1)
        jd.checkpoint.Checkpoint(model=fresh).read(path)
        for a, b in zip(jax.tree.leaves(nnx.state(fresh)), saved, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        return fresh

    second = mesh_strategy((1, 8, 1))
    restored = restore_into(second, True)
    layout = second.state_layout(restored)
    for name, value in zip(layout, jax.tree.leaves(nnx.state(restored)), strict=True):
        assert _spec_of(value, second, layout[name]), name
    mirrored = restore_into(jd.MirroredStrategy(), False)
    assert mirrored.blocks[0].up.kernel.get_value().sharding.is_fully_replicated
    again = restore_into(first, True)
    assert _spec_of(again.blocks[0].up.kernel.get_value(), first, P("fsdp", "tensor"))


def _token_split(strategy: jd.Strategy, tokens: np.ndarray) -> tuple:
    n = strategy.num_replicas_in_sync
    x, y = tokens[:, :-1].reshape(n, -1, 8), tokens[:, 1:].reshape(n, -1, 8)
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: (x[ctx.replica_id_in_sync_group], y[ctx.replica_id_in_sync_group])
    )


def _decoder_step(strategy: jd.Strategy) -> jd.TrainStep:
    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):  # type: ignore[no-untyped-def]
        def loss(m):  # type: ignore[no-untyped-def]
            xent = optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean(-1)
            return jd.compute_average_loss(xent, global_batch_size=16)

        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", value)

    return step


# experimental_create -------------------------------------------------------------------


def test_experimental_create_builds_a_model_larger_than_a_device_share() -> None:
    """A model 4x larger than each device's share (fsdp x tensor = 4 at (2,2,2)) is
    created in its layout: every device holds at most 1.05x its share of every leaf,
    and the values are those of ``jax.jit`` creation on one device."""
    strategy = mesh_strategy((2, 2, 2))

    def make() -> tuple[Decoder, nnx.Optimizer]:
        model = Decoder(nnx.Rngs(0), d=64, vocab=128)
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    model, opt = strategy.experimental_create(make)
    state = nnx.state((model, opt))
    share = ruled_share(strategy, (model, opt))
    assert per_device_bytes(state) <= 1.05 * share
    assert share <= 0.3 * total_bytes(state)
    with nnx.use_eager_sharding(False):
        want = jax.jit(lambda: jax.tree.leaves(nnx.state(make())))()
    for a, b in zip(jax.tree.leaves(state), want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _spec_of(model.blocks[0].attn.q.kernel.get_value(), strategy, P("fsdp", "tensor"))
    assert RULES[0] == ("batch", ("data", "fsdp"))


def test_fit_resumes_a_checkpoint_on_another_mesh(tmp_path: object) -> None:
    """One epoch at (2, 2, 2) with a `jd.training.Checkpoint`, then ``resume=True`` at
    (1, 8, 1) for the second epoch: the same losses and state as two epochs at (2, 2, 2)."""
    tokens = np.random.default_rng(1).integers(0, 64, size=(32, 9)).astype(np.int32)

    calls: list[int] = []

    def run(shape: tuple, epochs: int, directory: object) -> tuple[list[float], Decoder]:
        calls.append(0)
        strategy = mesh_strategy(shape)
        with strategy.scope():
            model = Decoder(nnx.Rngs(0), layers=1)
            opt = nnx.Optimizer(model, optax.adamw(3e-3, eps=1e-5), wrt=nnx.Param)
        step = _decoder_step(strategy)

        def fit_step(model, opt, batch):  # type: ignore[no-untyped-def]
            calls[-1] += 1
            return {"loss": step(model, opt, *batch)}

        data = jd.data.from_arrays(tokens[:, :-1], tokens[:, 1:], batch_size=16)
        history = jd.fit(
            fit_step,
            model,
            opt,
            data=data,
            epochs=epochs,
            verbose=False,
            strategy=strategy,
            callbacks=[jd.training.Checkpoint(str(directory))],
            resume=True,
        )
        return history.history["loss"], model

    _, _ = run((2, 2, 2), 1, tmp_path / "a")  # type: ignore[operator]
    resumed, model = run((1, 8, 1), 2, tmp_path / "a")  # type: ignore[operator]
    straight, ref = run((2, 2, 2), 2, tmp_path / "b")  # type: ignore[operator]
    assert calls == [2, 2, 4]  # the resumed run trained epoch 2 only
    np.testing.assert_allclose(resumed[-1], straight[-1], rtol=RTOL, atol=ATOL)
    _assert_close(nnx.state(model), nnx.state(ref))
