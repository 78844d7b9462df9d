"""`MeshStrategy` vs the same decoder written by hand the MaxText way, at each mesh shape.

The GPT-2-style decoder of `jaxdist.examples.gpt` (4 layers, d 256, 8 heads,
vocabulary 256, sequence 32), softmax cross-entropy, adamw(1e-3), float32,
global batch 16, on the (data, fsdp, tensor) meshes of the issue. Two sides per
shape, run in interleaved rounds on the same placed batch, each donating its
state and feeding it back:

- ``hand``: as MaxText writes it: one ``jax.jit`` of the global-batch step,
  parameters and optimizer state placed with ``NamedSharding``s from the same
  logical rules (``strategy.state_layout``: the same specs), the batch split
  over ``("data", "fsdp")``, and the same activations constrained with Flax's
  ``nn.with_logical_constraint`` (the rules with the batch axes kept); XLA's
  partitioner inserts every collective;
- ``MeshStrategy``: ``@jd.train_step`` over ``nnx.Module`` / ``nnx.Optimizer``
  (the user's step: ``ctx.all_reduce`` of the gradients) under
  ``jd.experimental.MeshStrategy``.

Prints, per shape: steps/s and tokens/s of each side, the throughput ratio
(MeshStrategy / hand), per-device memory (state held between steps, and the
compiled step's arguments and temporaries), the collectives of each compiled
step (count and result bytes by kind), and model FLOPs from the compiled
step's ``cost_analysis()`` with MFU where the device's dense peak is known
(H100: 989 TFLOP/s bf16; there is none for a CPU).

Usage: python benchmarks/mesh.py [--rounds N] [--shapes 2,2,2 1,8,1 ...]
"""

from __future__ import annotations

import re
import sys

import _harness
import jax
import numpy as np
import optax
from _nnx_sides import hand_side, jaxdist_side
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist.examples.gpt import RULES, SHAPES, Decoder, mesh_strategy

LAYERS, D, HEADS, VOCAB, SEQ, BATCH = 4, 256, 8, 256, 32, 16
PEAK_FLOPS = {"H100": 989e12}  # dense bf16, per device
_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_ARRAY = re.compile(r"(f32|f16|bf16|s32|u32|pred)\[([\d,]*)\]")
_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "pred": 1}


def _loss(model: Decoder, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean(axis=-1)


def _make(constrain: object = None) -> Decoder:
    extra = {} if constrain is None else {"constrain": constrain}
    return Decoder(nnx.Rngs(0), vocab=VOCAB, d=D, layers=LAYERS, heads=HEADS, length=SEQ, **extra)


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """``{opcode: (count, result bytes)}`` of a compiled module's collectives."""
    out: dict[str, tuple[int, int]] = {}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(" + "|".join(_OPS) + r")(?:-start)?\(", line)
        if m is None:
            continue
        size = sum(
            _BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            for t, dims in _ARRAY.findall(m.group(1))
        )
        count, total = out.get(m.group(2), (0, 0))
        out[m.group(2)] = (count + 1, total + size)
    return out


def sides(shape: tuple[int, int, int]) -> tuple[dict, dict]:
    tx = optax.adamw(1e-3)
    strategy = mesh_strategy(shape)
    mesh, n = strategy.mesh, strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    xg, yg = jax.device_put(tokens[:, :-1], batch), jax.device_put(tokens[:, 1:], batch)
    xs = jd.PerReplica(xg.reshape(n, BATCH // n, SEQ))
    ys = jd.PerReplica(yg.reshape(n, BATCH // n, SEQ))
    runs, info = {}, {}

    # 1. MaxText style: one jit of the global step, NamedShardings from the same rules.
    def constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
        return nn.with_logical_constraint(x, names, mesh=mesh, rules=RULES)

    with nnx.use_eager_sharding(False):
        model = _make(constrain)
        layout = strategy.state_layout((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

    def shardings_of(state: object) -> object:
        """The same specs as the strategy's (``state_layout``), by path."""

        def one(path: tuple, _: object) -> NamedSharding:
            keys = "/".join(
                str(next(getattr(k, a) for a in ("name", "key", "idx") if hasattr(k, a)))
                for k in path[1:]
            )
            prefix = "" if path[0].idx == 0 else "opt_state/"
            return NamedSharding(mesh, layout.get(prefix + keys, P()))

        return jax.tree_util.tree_map_with_path(one, state)

    runs["hand"], info["hand"] = hand_side(model, tx, _loss, shardings_of, xg, yg)

    # 2. jd.train_step under MeshStrategy.
    with strategy.scope():
        model = _make()
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    runs["MeshStrategy"], info["MeshStrategy"] = jaxdist_side(
        strategy, model, opt, _loss, BATCH, xs, ys
    )
    return runs, info


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    shapes = SHAPES
    if "--shapes" in sys.argv:
        given = sys.argv[sys.argv.index("--shapes") + 1 :]
        given = given[: next((i for i, a in enumerate(given) if a.startswith("--")), None)]
        shapes = [tuple(int(k) for k in a.split(",")) for a in given]
    _harness.setup_devices(8)
    print(_harness.describe_machine())
    print(
        f"decoder {LAYERS} layers, d {D}, seq {SEQ}, global batch {BATCH}, adamw; {rounds} rounds"
    )
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
    for shape in shapes:
        runs, info = sides(shape)
        samples = _harness.sample(runs, calls=3, rounds=rounds, warmup=1)
        ratio, q1, q3 = _harness.paired_ratios(samples, "hand")["MeshStrategy"]
        print(
            f"\nmesh (data, fsdp, tensor) = {shape}: throughput MeshStrategy / hand "
            f"{1 / ratio:.3f} (time ratio {ratio:.3f}, quartiles {q1:.3f}-{q3:.3f})"
        )
        for name, times in samples.items():
            t = float(np.median(times))
            held, compiled = info[name]
            memory = compiled.memory_analysis()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            flops = float(cost.get("flops", 0.0))
            mfu = "n/a" if peak is None else f"{flops / t / peak:.1%}"
            comms = ", ".join(
                f"{op} {c} ({b / 2**10:.0f} KiB)"
                for op, (c, b) in sorted(collectives(compiled.as_text()).items())
            )
            print(
                f"  {name:12s} {1 / t:6.2f} steps/s {BATCH * SEQ / t:9.0f} tokens/s  "
                f"state {held() / 2**20:6.2f} MiB  "
                f"args {memory.argument_size_in_bytes / 2**20:6.2f} "
                f"temp {memory.temp_size_in_bytes / 2**20:6.2f} MiB  "
                f"{flops / 1e9:.2f} GFLOP/step/device MFU {mfu}\n    collectives: {comms}"
            )


if __name__ == "__main__":
    main()
