"""One process of a multi-process test workload (run by tests/strategies/test_multi_worker.py).

Started with the environment jaxdist's launcher sets (``JAXDIST_COORDINATOR_ADDRESS``,
``JAXDIST_NUM_PROCESSES``, ``JAXDIST_PROCESS_ID``, ``JAX_NUM_CPU_DEVICES``), or
with none of it for the one-process reference. Writes what it computed to
``<out>/process<i>.json``.

Usage: workload.py OUT_DIR [RESTORE_FROM]
    RESTORE_FROM: a checkpoint written by another run of this workload (with
    another process layout), restored into this run's variables.

The data and the models are defined here once (`data`, `init_mlp`, `mlp`) so
the test computes its single-device reference from the same definitions.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

ROWS, FEATURES, HIDDEN = 100, 5, 16  # 100 rows in batches of 32: a partial last batch
BATCH, EPOCHS, LR = 32, 3, 0.1
PIPELINE_ROWS, PIPELINE_BATCH = 67, 16  # odd: the pipelines get 34 and 33 rows


def data() -> tuple[np.ndarray, np.ndarray]:
    """The training set: ``ROWS`` rows of ``FEATURES`` inputs and one target."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(FEATURES, 1))).astype(np.float32)
    return x, y


def init_mlp() -> dict[str, np.ndarray]:
    """The MLP's initial parameters (``FEATURES -> HIDDEN -> 1``), float32."""
    rng = np.random.default_rng(1)
    return {
        "w1": (rng.normal(size=(FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def mlp(params: dict[str, Any], x: Any) -> Any:
    """The MLP's output for inputs ``x`` (works on NumPy-like and traced arrays)."""
    import jax.numpy as jnp

    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def main(out_dir: str, restore_from: str | None) -> None:
    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import jax.numpy as jnp
    import optax
    from flax import nnx

    me = jax.process_index()
    result: dict[str, Any] = {
        "process": me,
        "processes": jax.process_count(),
        "replicas": strategy.num_replicas_in_sync,
        "local_replicas": len(strategy.extended.worker_devices),
    }
    x, y = data()

    # 1. An MLP of ON_WRITE variables, and ON_READ counters, over a distributed dataset.
    def make_variables(params: dict[str, np.ndarray]) -> dict[str, Any]:
        with strategy.scope():
            out = {
                k: jd.Variable(jnp.asarray(v), aggregation="mean", name=k)
                for k, v in params.items()
            }
            for name in ("seen", "loss"):  # ON_READ SUM counters
                out[name] = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
        return out

    state = make_variables(init_mlp())
    weights = ("w1", "b1", "w2", "b2")

    @strategy.function
    def step(ctx, state, batch):
        bx, by = batch
        mask = ctx.valid_mask(bx.shape[0])[:, None]
        total = ctx.global_num_valid.astype(jnp.float32)

        def loss_fn(params):
            return jnp.sum(jnp.where(mask, (mlp(params, bx) - by) ** 2, 0.0)) / total

        loss, grads = jax.value_and_grad(loss_fn)({k: state[k].read_value() for k in weights})
        n = ctx.num_replicas_in_sync
        # MEAN aggregation of n * (this replica's share of the global gradient) = the global
        # gradient: every replica's update is aggregated once, on write.
        new = {k: ctx.assign_sub(state[k], LR * grads[k] * n) for k in weights}
        new["seen"] = ctx.assign_add(state["seen"], jnp.sum(mask).astype(jnp.float32))
        new["loss"] = ctx.assign_add(state["loss"], loss * total)
        return new

    ds = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=BATCH))
    for _ in range(EPOCHS):
        for batch in ds:
            state = step(state, batch)
    for k in weights:
        result[k] = np.asarray(state[k].read_value()).ravel().tolist()
    result["seen"] = float(state["seen"].read_value())
    result["loss_sum"] = float(state["loss"].read_value())
    copies = strategy.experimental_local_results(jd.PerReplica(state["seen"].device_values))
    result["local_seen"] = [float(c) for c in copies]  # this process's replicas' own counts

    # 2. A Flax NNX model with jd.train_step.
    with strategy.scope():
        model = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)

    @jd.train_step(strategy)
    def train(ctx, model, opt, batch):
        bx, by = batch
        mask = ctx.valid_mask(bx.shape[0])[:, None]

        def loss_fn(m):
            err = jnp.where(mask, (m(bx) - by) ** 2, 0.0)
            return jnp.sum(err) / ctx.global_num_valid

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    for batch in ds:
        last = train(model, opt, batch)
    result["nnx_kernel"] = np.asarray(model.kernel.get_value()).ravel().tolist()
    result["nnx_loss"] = float(last)

    # 3. One input pipeline per process: which rows reached which replica, over one epoch.
    contexts = []

    def dataset_fn(ictx):
        contexts.append([ictx.num_input_pipelines, ictx.input_pipeline_id])
        ids = np.arange(PIPELINE_ROWS, dtype=np.float32)
        mine = ids[ictx.input_pipeline_id :: ictx.num_input_pipelines]
        return jd.data.from_arrays(mine, batch_size=ictx.get_per_replica_batch_size(PIPELINE_BATCH))

    local_rows: list[list[int]] = [[] for _ in strategy.extended.worker_devices]
    gathered: list[int] = []

    def mark_padding(ctx, b):
        return jnp.where(ctx.valid_mask(b.shape[0]), b, -1.0)

    trimmed: list[list[int]] = [[] for _ in strategy.extended.worker_devices]
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        marked = strategy.run(mark_padding, (batch,))  # padding rows are -1
        padded = strategy.experimental_local_results(jd.PerReplica(marked.array))
        for r, rows in enumerate(padded):
            local_rows[r].extend(int(i) for i in np.asarray(rows) if i >= 0)
        gathered.extend(np.asarray(strategy.gather(batch, axis=0)).astype(int).tolist())
        try:  # the same rows, with the padding left out by the batch's valid counts
            for r, rows in enumerate(strategy.experimental_local_results(marked)):
                trimmed[r].extend(int(i) for i in np.asarray(rows))
        except Exception as e:  # reported, and asserted on, by the test
            result["trimmed_error"] = f"{type(e).__name__}: {e}"
    result["pipelines"] = contexts
    result["local_rows"] = local_rows  # per local replica, in order
    result["trimmed_rows"] = trimmed
    result["gathered_rows"] = gathered  # every replica's rows, seen from this process

    # 4. Cross-replica API.
    per = strategy.run(lambda ctx: ctx.replica_id_in_sync_group * jnp.ones(2))
    result["local_results"] = [
        np.asarray(v).tolist() for v in strategy.experimental_local_results(per)
    ]
    result["reduce_sum"] = np.asarray(strategy.reduce("sum", per)).tolist()
    result["gather"] = np.asarray(strategy.gather(per, axis=0)).tolist()

    # 5. Checkpoint save (orbax, every process) and restore into fresh variables.
    saved = {k: state[k] for k in (*weights, "seen")}
    jd.checkpoint.save(os.path.join(out_dir, "ckpt"), saved)
    blank = {k: np.ones_like(v) for k, v in init_mlp().items()}
    for name, source in (("restored", os.path.join(out_dir, "ckpt")), ("moved", restore_from)):
        if source is None:
            continue
        template = {k: v for k, v in make_variables(blank).items() if k != "loss"}
        restored = jd.checkpoint.restore(source, template)
        for k in weights:
            result[f"{name}_{k}"] = np.asarray(restored[k].read_value()).ravel().tolist()
        result[f"{name}_seen"] = float(restored["seen"].read_value())

    with open(os.path.join(out_dir, f"process{me}.json"), "w") as f:
        json.dump(result, f)
    jd.cluster_resolver.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
