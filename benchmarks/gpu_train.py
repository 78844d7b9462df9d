"""Training steps on one accelerator: jaxdist vs hand-written JAX vs ``nnx.jit``.

Three models, adamw, float32, one device (``OneDeviceStrategy``), all in one process:

- ``mlp``: MLP 784-1024-1024-10 (relu), batch 512, softmax cross-entropy;
- ``tfm256``: a decoder-only transformer, d_model 256, 4 layers, 4 heads, 16 sequences
  of 128 tokens, vocabulary 1024, next-token cross-entropy;
- ``tfm768``: the same at GPT-2-small size: d_model 768, 12 layers, 12 heads, 8 x 512
  tokens, vocabulary 8192 (smaller than GPT-2's 50257: the embedding is not what is
  measured).

Four routes run the same step on the same placed batch:

- ``hand``: parameters and optimizer state as plain dicts (``nnx.to_pure_dict``), one
  ``jax.jit`` with both donated (the fastest hand-written route);
- ``nnx.jit``: ``nnx.jit`` over the model and ``nnx.Optimizer``, donated;
- ``train_step``: ``@jd.train_step`` over the model and optimizer;
- ``train_step k=8``: the same with ``steps_per_execution=8`` (8 steps per call).

Each route is timed in interleaved rounds (`_harness.sample`); the figure is the median
time per step, and the ratio is against ``hand`` in the same round. One JSON line per
model, with the model FLOPs per step (the hand step's cost analysis), the achieved
TFLOP/s and the MFU against the device's dense peak (``jaxdist.training.fit.throughput``,
the figures `jd.fit` reports; no MFU for a device without a known peak). ``--tiny``
shrinks every model to a few hundred parameters, to check on a CPU that the script runs
(its figures mean nothing).

Usage: python benchmarks/gpu_train.py [--tiny] [mlp] [tfm256] [tfm768]
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time

import _harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxdist as jd
from jaxdist.training.fit.throughput import compiled_flops, peak_flops_per_device

GROUP = 8

MODELS = {
    # name: (kind, sizes, batch, sequence length, layers, heads, vocabulary)
    "mlp": ("mlp", (784, 1024, 1024, 10), 512, 0, 0, 0, 0),
    "tfm256": ("tfm", 256, 16, 128, 4, 4, 1024),
    "tfm768": ("tfm", 768, 8, 512, 12, 12, 8192),
}
TINY = {
    "mlp": ("mlp", (16, 32, 32, 10), 8, 0, 0, 0, 0),
    "tfm256": ("tfm", 16, 2, 8, 2, 2, 32),
    "tfm768": ("tfm", 24, 2, 8, 3, 3, 32),
}


class MLP(nnx.Module):
    def __init__(self, sizes: tuple[int, ...], rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    def __init__(self, d: int, layers: int, heads: int, vocab: int, length: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (length, d)) * 0.02)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[None, : tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def make(spec: tuple) -> tuple[nnx.Module, np.ndarray, np.ndarray]:
    """The model and one batch (inputs, labels) as host arrays."""
    kind, size, batch, length, layers, heads, vocab = spec
    rng = np.random.default_rng(0)
    if kind == "mlp":
        model: nnx.Module = MLP(size, nnx.Rngs(0))
        x = rng.normal(size=(batch, size[0])).astype(np.float32)
        y = rng.integers(0, size[-1], size=(batch,)).astype(np.int32)
    else:
        model = Transformer(size, layers, heads, vocab, length, nnx.Rngs(0))
        tokens = rng.integers(0, vocab, size=(batch, length + 1)).astype(np.int32)
        x, y = tokens[:, :-1], tokens[:, 1:]
    return model, x, y


def loss_of(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(x), y))


def routes(spec: tuple) -> tuple[dict, int]:
    tx = optax.adamw(1e-4)
    strategy = jd.OneDeviceStrategy()
    device = strategy.extended.worker_devices[0]
    own = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))  # fresh buffers: all donate

    # hand: plain dicts, one jit, donated.
    model, xh, yh = make(spec)
    x, y = jax.device_put(xh, device), jax.device_put(yh, device)
    graphdef, state0 = nnx.split(model, nnx.Param)
    params0 = nnx.to_pure_dict(state0)
    leaves = len(jax.tree.leaves((params0, tx.init(params0))))

    def hand_loss(params, x, y):
        state = jax.tree.map(lambda v: v, state0)
        nnx.replace_by_pure_dict(state, params)
        return loss_of(nnx.merge(graphdef, state), x, y)

    @jax.jit
    def _hand(params, opt_state, x, y):
        loss, g = jax.value_and_grad(hand_loss)(params, x, y)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    hand = jax.jit(_hand, donate_argnums=(0, 1))
    hand_state = list(own((params0, tx.init(params0))))
    flops = compiled_flops(hand.lower(*hand_state, x, y).compile(), 1)  # the same step

    def run_hand():
        p, o, loss = hand(*hand_state, x, y)
        hand_state[:] = [p, o]
        loss.block_until_ready()

    # nnx.jit
    fmodel = make(spec)[0]
    fopt = nnx.Optimizer(fmodel, tx, wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def flax_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(loss_of)(model, x, y)
        opt.update(model, grads)
        return loss

    def run_flax():
        flax_step(fmodel, fopt, x, y).block_until_ready()

    # jd.train_step, one step and GROUP steps per call
    def jd_route(k: int):
        with strategy.scope():
            m = make(spec)[0]
            o = nnx.Optimizer(m, tx, wrt=nnx.Param)

        @jd.train_step(strategy, steps_per_execution=k)
        def step(ctx, model, opt, batch):
            bx, by = batch
            loss, grads = nnx.value_and_grad(loss_of)(model, bx, by)
            opt.update(model, ctx.all_reduce("mean", grads))
            return ctx.all_reduce("mean", loss)

        batch = (jd.PerReplica(x[None]), jd.PerReplica(y[None]))
        if k == 1:
            return lambda: step(m, o, batch).block_until_ready()
        batches = itertools.repeat(batch)
        return lambda: step(m, o, batches).block_until_ready()

    return (
        {
            "hand": run_hand,
            "nnx.jit": run_flax,
            "train_step": jd_route(1),
            f"train_step k={GROUP}": jd_route(GROUP),
        },
        leaves,
        flops,
    )


def measure(name: str, spec: tuple, rounds: int, budget_s: float) -> dict:
    cands, leaves, flops = routes(spec)
    for fn in cands.values():  # compile
        fn()
    start = time.perf_counter()
    cands["hand"]()
    one = time.perf_counter() - start
    calls = max(2, min(200, int(budget_s / max(one, 1e-6) / rounds / len(cands))))
    samples = _harness.sample(cands, calls=calls, rounds=rounds, warmup=2)
    key = f"train_step k={GROUP}"
    samples[key] = [t / GROUP for t in samples[key]]
    ratios = _harness.paired_ratios(samples, "hand")
    # Achieved model FLOP/s per step time, and MFU against the dense peak when known
    # (the calculator jd.fit uses; the model FLOPs from the hand step's cost analysis).
    peak = peak_flops_per_device()
    tflops = {k: flops / statistics.median(v) / 1e12 for k, v in samples.items()} if flops else {}
    return {
        "model": name,
        "state_leaves": leaves,
        "device": _harness.describe_machine(),
        "us_per_step": {k: round(statistics.median(v) * 1e6, 1) for k, v in samples.items()},
        "time_ratio_vs_hand": {k: round(ratios[k][0], 3) for k in samples},
        "ratio_quartiles": {k: [round(ratios[k][1], 3), round(ratios[k][2], 3)] for k in samples},
        "flops_per_step": flops,
        "tflops_per_device": {k: float(f"{v:.4g}") for k, v in tflops.items()},
        "mfu": {k: float(f"{v * 1e12 / peak:.4g}") for k, v in tflops.items()} if peak else None,
        "calls_per_round": calls,
        "rounds": rounds,
    }


def main() -> None:
    tiny = "--tiny" in sys.argv
    table = TINY if tiny else MODELS
    names = [a for a in sys.argv[1:] if a in table] or list(table)
    for name in names:
        result = measure(name, table[name], rounds=5 if tiny else 11, budget_s=2 if tiny else 60)
        if tiny:
            result["note"] = "--tiny: a check that the script runs, not a measurement"
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
