"""`FSDPStrategy.experimental_create`: training state created directly in slices (8 devices).

Reference: the same function called directly (plain NNX / optax creation on one
device, the same RNG seeds). Creation equals ``jax.jit(fn)`` on one device bit
for bit (the sharded jit computes the same threefry bits and the same fused
initializer arithmetic) and eager creation within 1 ulp (XLA fuses
``scale * normal(...)`` under jit, eager rounds twice); 5 adamw steps
after sharded creation equal 5 steps after creation under ``nnx.jit`` on one
device (losses, parameters, optimizer state at rtol 1e-5, atol 1e-6) and the
losses after eager creation (rtol 1e-5, atol 1e-6; its parameters are not
compared: adamw's division by sqrt(nu) magnifies the 1-ulp start of a
near-zero gradient to ~1e-5). The steps after
sharded creation must not move the state: `placed_copy` is never called).
Memory: right after creation every device holds at most 1.05 x total / 8 of
the state's bytes; the compiled initializer's per-device output is at most
1.05 x total / 8 and its temporaries at most 1.1 x total / 8 + 1 MiB.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd
from jaxdist.strategies._sharded_create import sharded_initializer
from jaxdist.training.step import sharded_state

from _helpers import per_device_bytes, total_bytes

pytestmark = pytest.mark.timeout(300)

N = 8
RTOL, ATOL = 1e-5, 1e-6


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Net(nnx.Module):
    """Embedding, 2 residual MLP blocks (d 128), a head; 0.3 M parameters."""

    def __init__(self, rngs: nnx.Rngs, d: int = 128, vocab: int = 64) -> None:
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (8, d)))
        self.layers = nnx.List([Block(d, rngs) for _ in range(2)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[None, : tokens.shape[1]]
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _make() -> tuple[Net, nnx.Optimizer]:
    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def _host(tree: object) -> list[np.ndarray]:
    out = []
    for leaf in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf))
    return out


def _step(strategy: jd.Strategy) -> jd.TrainStep:
    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):  # type: ignore[no-untyped-def]
        def loss_fn(m):  # type: ignore[no-untyped-def]
            per_token = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
            return jd.compute_average_loss(jnp.mean(per_token, axis=-1), global_batch_size=16)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    return step


def _batches(strategy: jd.Strategy, steps: int) -> list[tuple]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(steps, 16, 9)).astype(np.int32)
    out = []
    for t in tokens:
        x, y = t[:, :-1].reshape(N, 2, 8), t[:, 1:].reshape(N, 2, 8)
        out.append((jd.PerReplica(list(x)), jd.PerReplica(list(y))))
    return out


class _Copies:
    """Counts `placed_copy` calls of the train step (each one moves state)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = sharded_state.placed_copy

        def counting(*args: object) -> object:
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(sharded_state, "placed_copy", counting)


# Values ---------------------------------------------------------------------------------


def _assert_same_bits_and_eager_within_an_ulp(fn: object, got: object) -> None:
    """``got`` equals ``fn``'s state made by a one-device ``jax.jit`` bit for bit, and
    eager creation within 1 ulp (XLA fuses ``0.02 * normal(...)`` under jit)."""
    jitted = jax.jit(lambda: nnx.state(fn()))()
    eager = nnx.state(fn())
    assert jax.tree.structure(got) == jax.tree.structure(jitted)
    for a, b, c in zip(_host(got), _host(jitted), _host(eager), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_array_max_ulp(a, c, maxulp=1)
        else:
            np.testing.assert_array_equal(a, c)


def test_created_state_equals_normal_creation_bitwise() -> None:
    strategy = jd.experimental.FSDPStrategy(rules=((r"norm", None),))
    model, opt = strategy.experimental_create(_make)
    _assert_same_bits_and_eager_within_an_ulp(_make, nnx.state((model, opt)))
    assert model.layers[0].up.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(
        "replica"
    )
    mu = opt.opt_state[0].mu.layers[1].down.kernel.get_value()
    assert mu.addressable_shards[0].data.shape == (512 // N, 128)
    assert model.layers[0].norm.scale.get_value().sharding.spec == jax.sharding.PartitionSpec()


def test_a_module_and_arguments_are_created_equal_and_sharded() -> None:
    strategy = jd.experimental.FSDPStrategy(min_shard_bytes=1024)
    model = strategy.experimental_create(
        lambda d_in, d_out, seed: nnx.Linear(d_in, d_out, rngs=nnx.Rngs(seed)), 64, 256, seed=3
    )
    _assert_same_bits_and_eager_within_an_ulp(
        lambda: nnx.Linear(64, 256, rngs=nnx.Rngs(3)), nnx.state(model)
    )
    assert model.kernel.get_value().addressable_shards[0].data.shape == (8, 256)


def test_a_train_state_is_created_equal_and_sharded() -> None:
    strategy = jd.experimental.FSDPStrategy(min_shard_bytes=1024)

    def make(seed: int) -> jd.TrainState:
        k1, k2 = jax.random.split(jax.random.key(seed))
        params = {"w1": jax.random.normal(k1, (64, 256)), "w2": jax.random.normal(k2, (256, 8))}
        return jd.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))

    state = strategy.experimental_create(make, 7)
    ref = jax.jit(lambda: jax.tree.leaves(make(7)))()
    assert isinstance(state, jd.TrainState)
    for a, b, c in zip(_host(state), _host(ref), _host(make(7)), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_max_ulp(a, c, maxulp=1)
    assert state.params["w1"].addressable_shards[0].data.shape == (8, 256)
    assert state.opt_state[0].nu["w2"].addressable_shards[0].data.shape == (256 // N, 8)
    assert state.step.sharding.spec == jax.sharding.PartitionSpec()


# Memory ---------------------------------------------------------------------------------


def test_each_device_holds_an_eighth_and_the_initializer_needs_no_more() -> None:
    # Every leaf sharded (only the scalar counters stay replicated): the bound is tight.
    strategy = jd.experimental.FSDPStrategy(min_shard_bytes=0)
    model, opt = strategy.experimental_create(_make)
    state = nnx.state((model, opt))
    total = total_bytes(state)
    assert per_device_bytes(state) <= 1.05 * total / N
    init, _ = sharded_initializer(strategy, _make, (), {}, "FSDPStrategy.experimental_create")
    memory = init.lower().compile().memory_analysis()
    assert memory.output_size_in_bytes <= 1.05 * total / N, (memory, total)
    assert memory.temp_size_in_bytes <= 1.1 * total / N + (1 << 20), (memory, total)
    mirrored = jax.jit(lambda: jax.tree.leaves(nnx.state(_make())))
    whole = mirrored.lower().compile().memory_analysis()
    assert whole.output_size_in_bytes >= 0.95 * total  # the reference: all of it on one device


# Training -------------------------------------------------------------------------------


def test_five_adamw_steps_equal_normal_creation_and_move_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    strategy = jd.experimental.FSDPStrategy(rules=((r"norm", None),))
    batches = _batches(strategy, 5)
    copies = _Copies(monkeypatch)

    model, opt = strategy.experimental_create(_make)
    before = [v.get_value() for v in jax.tree.leaves(nnx.state((model, opt)), is_leaf=_is_var)]
    step = _step(strategy)
    losses = [float(step(model, opt, x, y)) for x, y in batches]
    assert copies.calls == 0  # the state was already where the step keeps it
    assert all(b.is_deleted() for b in before)  # donated in place: never copied first

    # The reference: the same function run normally on one device under nnx.jit (the same
    # bits as the sharded creation), then the same 5 steps; its first step places it.
    ref_model, ref_opt = nnx.jit(_make)()
    ref_step = _step(strategy)
    ref_losses = [float(ref_step(ref_model, ref_opt, x, y)) for x, y in batches]
    assert copies.calls >= 1  # the control: a whole model is placed by the first step
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    got, want = nnx.state((model, opt)), nnx.state((ref_model, ref_opt))
    for a, b in zip(_host(got), _host(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    # Eager creation starts up to 1 ulp away (the embedding); the losses still agree.
    eager_model, eager_opt = _make()
    eager_step = _step(strategy)
    eager_losses = [float(eager_step(eager_model, eager_opt, x, y)) for x, y in batches]
    np.testing.assert_allclose(losses, eager_losses, rtol=RTOL, atol=ATOL)


def test_a_created_train_state_trains_like_a_normal_one_and_moves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    strategy = jd.experimental.FSDPStrategy(min_shard_bytes=1024)
    copies = _Copies(monkeypatch)
    rng = np.random.default_rng(2)
    xs = rng.normal(size=(5, N, 4, 64)).astype(np.float32)
    ys = rng.normal(size=(5, N, 4, 8)).astype(np.float32)

    def apply(params, x):  # type: ignore[no-untyped-def]
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def make() -> jd.TrainState:
        key = jax.random.key(5)
        params = {"w1": jax.random.uniform(key, (64, 256)) - 0.5, "w2": jnp.ones((256, 8)) / 64}
        return jd.TrainState.create(apply_fn=apply, params=params, tx=optax.adamw(1e-2))

    def train(state: jd.TrainState) -> tuple[list[float], jd.TrainState]:
        @jd.train_step(strategy)
        def step(ctx, state, x, y):  # type: ignore[no-untyped-def]
            def loss(p):  # type: ignore[no-untyped-def]
                per_example = jnp.mean((state.apply_fn(p, x) - y) ** 2, axis=-1)
                return jd.compute_average_loss(per_example, global_batch_size=N * 4)

            value, grads = jax.value_and_grad(loss)(state.params)
            new = state.apply_gradients(grads=ctx.all_reduce("sum", grads))
            return new, ctx.all_reduce("sum", value)

        losses = []
        for x, y in zip(xs, ys, strict=True):
            state, value = step(state, jd.PerReplica(list(x)), jd.PerReplica(list(y)))
            losses.append(float(value))
        return losses, state

    created = strategy.experimental_create(make)
    ref = make()  # eager, on one device: uniform initializers give the same bits
    for a, b in zip(_host(created), _host(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    losses, state = train(created)
    assert copies.calls == 0
    ref_losses, ref_state = train(ref)
    assert copies.calls >= 1  # the control: the eager state is placed by the first step
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    for a, b in zip(_host(state), _host(ref_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    assert state.params["w1"].addressable_shards[0].data.shape == (8, 256)


def _is_var(x: object) -> bool:
    return isinstance(x, nnx.Variable)


# Errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (3, r"experimental_create: fn must be a callable that builds the state, got int"),
        (nnx.Linear(2, 2, rngs=nnx.Rngs(0)), r"got an already built Linear object"),
    ],
)
def test_fn_must_be_a_callable_building_the_state(fn: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        jd.experimental.FSDPStrategy().experimental_create(fn)


def test_nnx_objects_as_arguments_are_refused_with_the_fix() -> None:
    strategy = jd.experimental.FSDPStrategy()
    with pytest.raises(TypeError, match=r"NNX objects cannot be arguments of fn: kwargs\['rngs'\]"):
        strategy.experimental_create(nnx.Linear, 64, 256, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("fn", "error", "match"),
    [
        (lambda: "model", TypeError, r"experimental_create: fn must return NNX objects"),
        (lambda: {"w": jnp.ones(4), "name": "x"}, TypeError, r"fn must return NNX objects"),
        (lambda: None, ValueError, r"experimental_create: fn returned no arrays"),
    ],
)
def test_fn_must_return_state(fn: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        jd.experimental.FSDPStrategy().experimental_create(fn)


def test_rule_errors_surface_listing_every_leaf() -> None:
    def make() -> dict:
        return {"odd": jnp.zeros((7, 1001)), "bad": jnp.zeros((64, 100)), "ok": jnp.zeros((64, 64))}

    strategy = jd.experimental.FSDPStrategy(rules=((r"bad", 1),))
    with pytest.raises(ValueError, match=r"experimental_create: cannot shard") as info:
        strategy.experimental_create(make)
    message = str(info.value)
    assert "odd of shape (7, 1001)" in message and "no dimension is divisible" in message
    assert "bad of shape (64, 100): rule ('bad', 1)" in message


def test_the_replicated_fraction_guard_applies() -> None:
    strategy = jd.experimental.FSDPStrategy(
        rules=((r"kernel", None),), max_replicated_fraction=0.02
    )
    with pytest.raises(ValueError, match=r"max_replicated_fraction=0.02.*kernel"):
        strategy.experimental_create(lambda: nnx.Linear(64, 256, rngs=nnx.Rngs(0)))


def test_an_anchored_rule_applies_inside_each_returned_object() -> None:
    """Paths start inside each object ``fn`` returns, so ``^kernel`` names the model's
    kernel (dimension 1) and not the optimizer's ``opt_state/0/mu/kernel`` (its first
    divisible dimension, 0). A path with the element index (``0/kernel``) or the
    rules not applied would shard the kernel on dimension 0, or fail."""
    spec = jax.sharding.PartitionSpec
    strategy = jd.experimental.FSDPStrategy(min_shard_bytes=1024, rules=((r"^kernel", 1),))

    def make() -> tuple[nnx.Linear, nnx.Optimizer]:
        model = nnx.Linear(64, 512, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    model, opt = strategy.experimental_create(make)
    assert model.kernel.get_value().sharding.spec == spec(None, "replica")
    assert opt.opt_state[0].mu["kernel"].get_value().sharding.spec == spec("replica")
    assert strategy.state_layout((model, opt))["kernel"] == spec(None, "replica")
    # A lone module: its paths start inside it too.
    alone = strategy.experimental_create(lambda: nnx.Linear(64, 512, rngs=nnx.Rngs(0)))
    assert alone.kernel.get_value().sharding.spec == spec(None, "replica")
