"""`jd.experimental.FSDPStrategy`: training state sharded over 8 devices, results as Mirrored.

Parity: 20 adamw steps under `FSDPStrategy` equal the same steps under
`MirroredStrategy` (rtol 1e-5, atol 1e-6; the replica functions compute the
same values on the gathered state), and the MLP also equals plain
single-device optax training on the global batches (losses rtol 1e-5, atol
1e-6; parameters atol 1e-5, see the test). Memory: the per-device bytes of parameters and
optimizer state, read from the arrays' shards and from the compiled step's
memory analysis, are at most 1.05 x total / 8 under FSDP and the whole total
under Mirrored.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd
from jaxdist.strategies.fsdp import shard_dims

from _helpers import TanhMLP, per_device_bytes, regression_data, total_bytes

pytestmark = pytest.mark.timeout(300)

STEPS = 20
RTOL, ATOL = 1e-5, 1e-6
N = 8


MLP = functools.partial(TanhMLP, (32, 256, 256, 16))


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        # No attention biases: the key bias's gradient is zero in exact arithmetic (softmax
        # is shift invariant), so its value would be rounding noise, not a comparable result.
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=d, decode=False, use_bias=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    """A decoder: 4 layers, d 256, 4 heads, vocabulary 256, sequence 16."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 4, d: int = 256, vocab: int = 256) -> None:
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (16, d)))
        self.layers = nnx.List([Block(d, 4, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[None, : tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.layers:
            x = block(x, mask)
        return self.head(self.norm(x))


def _mlp_data(batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    return regression_data((STEPS, batch), 32, 16)


def _token_data(batch: int = 8, seq: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, size=(STEPS, batch, seq + 1)).astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


def _mse(model: nnx.Module, x: jax.Array, y: jax.Array, global_batch: int) -> jax.Array:
    return jd.compute_average_loss(
        jnp.mean((model(x) - y) ** 2, axis=-1), global_batch_size=global_batch
    )


def _xent(model: nnx.Module, x: jax.Array, y: jax.Array, global_batch: int) -> jax.Array:
    per_token = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
    return jd.compute_average_loss(jnp.mean(per_token, axis=-1), global_batch_size=global_batch)


def _nnx_step(strategy: jd.Strategy, loss: object, global_batch: int) -> jd.TrainStep:
    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):  # type: ignore[no-untyped-def]
        value, grads = nnx.value_and_grad(lambda m: loss(m, x, y, global_batch))(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", value)

    return step


def _train_nnx(strategy: jd.Strategy, make: object, data: tuple, loss: object) -> tuple:
    model = make(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    xs, ys = data
    step = _nnx_step(strategy, loss, xs.shape[1])
    losses = []
    for x, y in zip(xs, ys, strict=True):
        losses.append(float(step(model, opt, *_split(strategy, x, y))))
    return losses, model, opt, step


def _split(strategy: jd.Strategy, x: np.ndarray, y: np.ndarray) -> tuple:
    """The global batch ``(x, y)`` as `PerReplica` values: replica r gets the r-th rows."""
    n = strategy.num_replicas_in_sync

    def rows(ctx: jd.experimental.ValueContext) -> tuple:
        r = ctx.replica_id_in_sync_group
        return x.reshape(n, -1, *x.shape[1:])[r], y.reshape(n, -1, *y.shape[1:])[r]

    return strategy.experimental_distribute_values_from_function(rows)


def _host(tree: object) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _assert_close(a: object, b: object, rtol: float = RTOL, atol: float = ATOL) -> None:
    la, lb = _host(a), _host(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


# Parity -------------------------------------------------------------------------------


def test_mlp_20_adamw_steps_equal_mirrored_and_one_device() -> None:
    data = _mlp_data()
    fsdp = jd.experimental.FSDPStrategy(min_shard_bytes=1024)
    lf, mf, of, step = _train_nnx(fsdp, MLP, data, _mse)
    lm, mm, om, _ = _train_nnx(jd.MirroredStrategy(), MLP, data, _mse)
    np.testing.assert_allclose(lf, lm, rtol=RTOL, atol=ATOL)
    _assert_close(nnx.state(mf), nnx.state(mm))
    _assert_close(nnx.state(of), nnx.state(om))
    # Sharded at rest: each kernel and its adamw moments on dim 0 (1 KiB and up).
    assert mf.l2.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec("replica")
    assert of.opt_state[0].mu["l2"]["kernel"].get_value().sharding.spec[0] == "replica"
    # ZeRO-3's communication: the 5 sharded parameters (3 kernels, 2 biases of 1 KiB)
    # gathered, their gradients reduce-scattered; the optimizer state is never gathered;
    # all-reduces only for the replicated l3 bias's gradient and the loss.
    hlo = step.lower(mf, of, *_split(fsdp, data[0][0], data[1][0])).as_text()
    assert hlo.count('"stablehlo.all_gather"') == 5
    assert hlo.count('"stablehlo.reduce_scatter"') == 5
    assert hlo.count('"stablehlo.all_reduce"') == 2

    # Plain single-device optax on the global batches.
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-3)

    @jax.jit
    def ref_step(params, opt_state, x, y):  # type: ignore[no-untyped-def]
        def loss(p):  # type: ignore[no-untyped-def]
            return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = tx.init(params)
    ref_losses = []
    for x, y in zip(*data, strict=True):
        params, opt_state, value = ref_step(params, opt_state, x, y)
        ref_losses.append(float(value))
    np.testing.assert_allclose(lf, ref_losses, rtol=RTOL, atol=ATOL)
    # adamw divides by sqrt(nu): a gradient near zero summed in another order can move a
    # weight by up to ~lr * 1e-3 differently, hence atol 1e-5 against one device.
    _assert_close(nnx.state(mf, nnx.Param), params, atol=1e-5)


def test_transformer_20_adamw_steps_equal_mirrored_with_an_eighth_of_the_state() -> None:
    data = _token_data()
    fsdp = jd.experimental.FSDPStrategy()
    mirrored = jd.MirroredStrategy()
    lf, mf, of, step_f = _train_nnx(fsdp, Transformer, data, _xent)
    lm, mm, om, step_m = _train_nnx(mirrored, Transformer, data, _xent)
    assert lf[-1] < lf[0]
    np.testing.assert_allclose(lf, lm, rtol=RTOL, atol=ATOL)
    _assert_close(nnx.state(mf), nnx.state(mm))
    _assert_close(nnx.state(of), nnx.state(om))
    # The attention output kernel (heads, head_dim, d) = (4, 64, 256): 4 does not divide
    # by 8, so its first divisible dimension (1) is sharded.
    out_kernel = mf.layers[0].attn.out.kernel.get_value()
    assert out_kernel.sharding.spec == jax.sharding.PartitionSpec(None, "replica")

    # Memory: parameters + optimizer state per device, from the arrays' shards and from
    # the compiled step's arguments (the state's slices plus the batch's rows).
    x, y = data[0][0], data[1][0]
    batch_bytes = (x.nbytes + y.nbytes) // N
    state_f, state_m = nnx.state((mf, of)), nnx.state((mm, om))
    total = total_bytes(state_f)
    assert total_bytes(state_m) == total
    assert per_device_bytes(state_f) <= 1.05 * total / N, (per_device_bytes(state_f), total)
    assert per_device_bytes(state_m) == total
    args_f = step_f.lower(mf, of, *_split(fsdp, x, y)).compile().memory_analysis()
    args_m = step_m.lower(mm, om, *_split(mirrored, x, y)).compile().memory_analysis()
    assert args_f.argument_size_in_bytes <= 1.05 * total / N + batch_bytes
    assert args_m.argument_size_in_bytes >= total


@pytest.mark.parametrize("count", [1, 2])
def test_fewer_devices_equal_mirrored_on_the_same_devices(count: int) -> None:
    devices = jax.devices()[:count]
    xs, ys = (a[:3] for a in _mlp_data(batch=8))
    fsdp = jd.experimental.FSDPStrategy(devices, min_shard_bytes=1024)
    lf, mf, of, _ = _train_nnx(fsdp, MLP, (xs, ys), _mse)
    lm, mm, om, _ = _train_nnx(jd.MirroredStrategy(devices), MLP, (xs, ys), _mse)
    np.testing.assert_allclose(lf, lm, rtol=RTOL, atol=ATOL)
    _assert_close(nnx.state((mf, of)), nnx.state((mm, om)))
    kernel = mf.l2.kernel.get_value()
    assert kernel.addressable_shards[0].data.shape == (256 // count, 256)
    assert len(kernel.sharding.device_set) == count


def test_an_update_that_mixes_elements_equals_mirrored() -> None:
    """A global-norm clip needs whole gradients: they are all-reduced, then sliced."""
    xs, ys = (a[:5] for a in _mlp_data())
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-3))

    def run(strategy: jd.Strategy) -> tuple:
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = _nnx_step(strategy, _mse, xs.shape[1])
        batches = [_split(strategy, x, y) for x, y in zip(xs, ys, strict=True)]
        losses = [float(step(model, opt, *batch)) for batch in batches]
        return losses, nnx.state((model, opt))

    lf, sf = run(jd.experimental.FSDPStrategy(min_shard_bytes=1024))
    lm, sm = run(jd.MirroredStrategy())
    np.testing.assert_allclose(lf, lm, rtol=RTOL, atol=ATOL)
    _assert_close(sf, sm)


def test_train_state_steps_equal_mirrored_and_come_back_sharded() -> None:
    xs, ys = _mlp_data()

    def apply(params, x):  # type: ignore[no-untyped-def]
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        return h @ params["w2"]

    key1, key2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(key1, (32, 256)) / 6,
        "b1": jnp.zeros((256,)),
        "w2": jax.random.normal(key2, (256, 16)) / 16,
    }

    def run(strategy: jd.Strategy) -> tuple:
        with strategy.scope():
            state = jd.TrainState.create(apply_fn=apply, params=params, tx=optax.adamw(1e-3))

        @jd.train_step(strategy)
        def step(ctx, state, x, y):  # type: ignore[no-untyped-def]
            def loss(p):  # type: ignore[no-untyped-def]
                return jd.compute_average_loss(
                    jnp.mean((state.apply_fn(p, x) - y) ** 2, axis=-1),
                    global_batch_size=xs.shape[1],
                )

            value, grads = jax.value_and_grad(loss)(state.params)
            state = state.apply_gradients(grads=ctx.all_reduce("sum", grads))
            return state, ctx.all_reduce("sum", value)

        losses = []
        for x, y in zip(xs, ys, strict=True):
            state, value = step(state, *_split(strategy, x, y))
            losses.append(float(value))
        return losses, state

    lf, sf = run(jd.experimental.FSDPStrategy(min_shard_bytes=2048))
    lm, sm = run(jd.MirroredStrategy())
    np.testing.assert_allclose(lf, lm, rtol=RTOL, atol=ATOL)
    _assert_close(sf.params, sm.params)
    _assert_close(sf.opt_state, sm.opt_state)
    assert int(sf.step) == STEPS
    assert sf.params["w1"].sharding.spec[0] == "replica"
    assert sf.opt_state[0].nu["w2"].sharding.spec[0] == "replica"
    assert sf.params["b1"].sharding.is_fully_replicated  # 1 KiB: below min_shard_bytes


def test_fit_runs_unchanged_and_equals_mirrored() -> None:
    x, y = (a.reshape(-1, a.shape[-1]) for a in _mlp_data())

    def run(strategy: jd.Strategy) -> tuple:
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

        @jd.train_step(strategy)
        def step(ctx, model, opt, batch):  # type: ignore[no-untyped-def]
            bx, by = batch
            value, grads = nnx.value_and_grad(lambda m: _mse(m, bx, by, 64))(model)
            opt.update(model, ctx.all_reduce("sum", grads))
            return {"loss": ctx.all_reduce("sum", value)}

        data = jd.data.from_arrays(x, y, batch_size=64)
        history = jd.fit(step, model, opt, data=data, steps=8, verbose=False)
        return history.history["loss"], model

    hf, mf = run(jd.experimental.FSDPStrategy(min_shard_bytes=1024))
    hm, mm = run(jd.MirroredStrategy())
    np.testing.assert_allclose(hf, hm, rtol=RTOL, atol=ATOL)
    _assert_close(nnx.state(mf), nnx.state(mm))
    assert not mf.l1.kernel.get_value().sharding.is_fully_replicated


# Rules and errors -----------------------------------------------------------------------


def _leaf(*shape: int, dtype: object = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def test_rules_first_match_wins_and_none_replicates() -> None:
    leaves = [
        ("layers/0/kernel", _leaf(64, 256)),
        ("opt_state/0/mu/layers/0/kernel", _leaf(64, 256)),
        ("embed/embedding", _leaf(256, 64)),
        ("norm/scale", _leaf(8192)),
        ("layers/0/bias", _leaf(256)),  # 1 KiB: below min_shard_bytes
        ("step", _leaf(dtype=jnp.int32)),
    ]
    rules = ((r"embed", -1), (r"norm", None), (r"layers/\d+/kernel", 1), (r".*", 0))
    dims = shard_dims(leaves, N, rules=rules, min_shard_bytes=4096)
    assert dims == [1, 1, 1, None, None, None]
    # No rules: the first divisible dimension of each large leaf.
    assert shard_dims(leaves, N, min_shard_bytes=4096) == [0, 0, 0, 0, None, None]
    # The strategy reads its own rules; a rule naming a small leaf leaves it replicated.
    s = jd.experimental.FSDPStrategy(rules=((r"bias", 0),), min_shard_bytes=4096)
    assert s.state_layout(leaves[4:5]) == {"layers/0/bias": jax.sharding.PartitionSpec()}
    assert s.rules == ((r"bias", 0),)


def test_rules_apply_to_nnx_and_optimizer_paths_in_a_step() -> None:
    strategy = jd.experimental.FSDPStrategy(
        min_shard_bytes=1024, rules=((r"l2/kernel", 1), (r"l1/", None))
    )
    x, y = (a[:1] for a in _mlp_data())
    _, model, opt, _ = _train_nnx(strategy, MLP, (x, y), _mse)
    spec = jax.sharding.PartitionSpec
    assert model.l2.kernel.get_value().sharding.spec == spec(None, "replica")
    assert opt.opt_state[0].mu["l2"]["kernel"].get_value().sharding.spec == spec(None, "replica")
    assert model.l1.kernel.get_value().sharding.is_fully_replicated  # (r"l1/", None)
    assert opt.opt_state[0].nu["l1"]["kernel"].get_value().sharding.is_fully_replicated
    assert model.l3.kernel.get_value().sharding.spec == spec("replica")  # no rule: dim 0


def test_a_large_leaf_no_rule_can_shard_is_an_error_naming_every_one() -> None:
    class Odd(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.a = nnx.Linear(30, 30, rngs=rngs)
            self.b = nnx.Linear(30, 9, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.b(self.a(x))

    strategy = jd.experimental.FSDPStrategy(min_shard_bytes=1024)
    model = Odd(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = _nnx_step(strategy, _mse, 8)
    x = np.zeros((8, 30), np.float32)
    y = np.zeros((8, 9), np.float32)
    with pytest.raises(ValueError, match=r"cannot shard the training state") as info:
        step(model, opt, *_split(strategy, x, y))
    message = str(info.value)
    assert "jaxdist.train_step(step)" in message
    assert re.search(r"a/kernel of shape \(30, 30\) .*no dimension is divisible by the 8", message)
    assert "b/kernel of shape (30, 9)" in message  # every problem, not the first alone
    assert "rules=()" in message


def test_rule_errors_are_collected() -> None:
    leaves = [("w", _leaf(64, 12)), ("v", _leaf(64, 64))]
    with pytest.raises(ValueError, match=r"rule \('w', 1\) shards dimension 1 of size 12") as e:
        shard_dims(leaves, N, rules=(("w", 1), ("v", 2)), min_shard_bytes=0)
    assert "rule ('v', 2) names dimension 2, but the leaf has rank 2" in str(e.value)


def test_max_replicated_fraction_lists_the_five_largest_replicated_leaves() -> None:
    leaves = [(f"norm{i}/scale", _leaf(1024 * (i + 1))) for i in range(7)]
    leaves.append(("layers/0/kernel", _leaf(1024, 1024)))
    rules = ((r"norm", None),)
    shard_dims(leaves, N, rules=rules, max_replicated_fraction=0.2)  # ~2.6%: fine
    with pytest.raises(ValueError, match=r"more than max_replicated_fraction=0\.01") as e:
        shard_dims(leaves, N, rules=rules, max_replicated_fraction=0.01)
    message = str(e.value)
    for i in (6, 5, 4, 3, 2):
        assert f"norm{i}/scale ({1024 * (i + 1)},)" in message
    assert "norm1/scale" not in message and "norm0/scale" not in message
    # One error: the guard and a leaf without a divisible dimension together.
    with pytest.raises(ValueError, match=r"odd of shape \(9, 1001\)[\s\S]*max_replicated") as e:
        shard_dims([*leaves, ("odd", _leaf(9, 1001))], N, rules=rules, max_replicated_fraction=0.01)


def test_the_guard_fires_in_a_step() -> None:
    strategy = jd.experimental.FSDPStrategy(
        min_shard_bytes=1024, rules=((r"l2/", None),), max_replicated_fraction=0.02
    )
    x, y = (a[:1] for a in _mlp_data())
    with pytest.raises(ValueError, match=r"largest replicated leaves: .*l2/kernel \(256, 256\)"):
        _train_nnx(strategy, MLP, (x, y), _mse)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_shard_bytes": -1}, r"min_shard_bytes=\.\.\.\): expected a non-negative int"),
        ({"max_replicated_fraction": 2.0}, r"expected a fraction in \[0, 1\]"),
        ({"rules": [("ok", 0), ("bad",)]}, r"rules\[1\] must be a \(regex, dim or None\) pair"),
        ({"rules": [("(", 0)]}, r"rules\[0\] has an invalid regex"),
        ({"rules": 3}, r"rules=\.\.\.\): expected a sequence of pairs, got int"),
    ],
)
def test_constructor_checks_its_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        jd.experimental.FSDPStrategy(**kwargs)


def test_strategy_is_a_value() -> None:
    a = jd.experimental.FSDPStrategy(rules=[("x", 0)])
    assert a == jd.experimental.FSDPStrategy(rules=(("x", 0),))
    assert a != jd.experimental.FSDPStrategy(rules=(("x", 1),))
    assert a != jd.MirroredStrategy()
    assert hash(a) == hash(jd.experimental.FSDPStrategy(rules=(("x", 0),)))
    assert a.num_replicas_in_sync == N and dict(a.mesh.shape) == {"replica": N}
    # run keeps MirroredStrategy's semantics.
    out = a.run(lambda ctx, v: ctx.all_reduce("sum", v), args=(jnp.ones(3),))
    np.testing.assert_allclose(np.asarray(out), np.full(3, float(N)))


# Issue 29: the default devices, rules that match nothing, state_layout's mapping ---------


def test_the_default_is_every_device_of_the_job_connected_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process of a 2 x 4 job sees 4 local devices and 8 in all: the strategy spans 8
    (before: 4, each process training its own copy) and connects the job first."""
    from jaxdist.strategies import _job

    everything = jax.devices()
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: everything[:4])
    connected: list[object] = []
    resolver = object()
    monkeypatch.setattr(_job, "resolve_default", lambda: resolver)
    monkeypatch.setattr(_job, "initialize", connected.append)
    s = jd.experimental.FSDPStrategy()
    assert s.replica_devices == tuple(everything)
    assert s.num_replicas_in_sync == N
    assert connected == [resolver]
    # Explicit devices are still taken as given.
    assert jd.experimental.FSDPStrategy(devices=everything[:2]).num_replicas_in_sync == 2


def test_state_layout_maps_each_path_to_its_partition_spec() -> None:
    s = jd.experimental.FSDPStrategy(min_shard_bytes=1024, rules=((r"l1/", None),))
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    spec = jax.sharding.PartitionSpec
    layout = s.state_layout((model, opt))
    assert layout["l2/kernel"] == spec("replica")
    assert layout["opt_state/0/mu/l2/kernel"] == spec("replica")
    assert layout["l1/kernel"] == spec()  # the rule replicates it
    assert layout["step"] == spec()
    assert len(layout) == len(jax.tree.leaves(nnx.state((model, opt))))
    # The layout the step keeps is the one announced.
    x, y = (a[:1] for a in _mlp_data())
    _, model, opt, _ = _train_nnx(s, MLP, (x, y), _mse)
    for path, value in [("l2/kernel", model.l2.kernel), ("l1/kernel", model.l1.kernel)]:
        assert value.get_value().sharding.spec == layout[path]


def test_a_rule_that_matches_no_leaf_is_an_error_naming_it() -> None:
    s = jd.experimental.FSDPStrategy(
        min_shard_bytes=1024, rules=((r"l2/kernal", 1), (r"l1/", None), (r"^norm", None))
    )
    model = MLP(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"rules\[0\] \('l2/kernal', 1\) matches no leaf") as e:
        s.state_layout(model)
    assert "rules[2] ('^norm', None) matches no leaf" in str(e.value)
    assert "rules[1]" not in str(e.value)
    with pytest.raises(ValueError, match=r"rules\[0\] \('l2/kernal', 1\) matches no leaf"):
        s.experimental_create(lambda: MLP(nnx.Rngs(0)))
    # A rule that matches only small (replicated) leaves is in use.
    s = jd.experimental.FSDPStrategy(min_shard_bytes=1024, rules=((r"bias", None),))
    assert s.state_layout(model)["l1/bias"] == jax.sharding.PartitionSpec()


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ("kernel", r"got a str \('kernel'\): rules are ordered .* rules=\(\('kernel', 0\),\)"),
        ({"kernel": 0}, r"got a dict: rules are ordered .*=tuple\(\{'kernel': 0\}\.items\(\)\)"),
    ],
)
def test_rules_given_as_a_string_or_dict_are_refused_saying_so(rules: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        jd.experimental.FSDPStrategy(rules=rules)  # type: ignore[arg-type]
