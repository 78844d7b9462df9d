"""One process of a multi-process test workload (run by tests/test_multi_process.py).

Started with the environment jaxdist's launcher sets (``JAXDIST_COORDINATOR_ADDRESS``,
``JAXDIST_NUM_PROCESSES``, ``JAXDIST_PROCESS_ID``, ``JAX_NUM_CPU_DEVICES``), or
with none of it for the one-process reference. Writes what it computed to
``<out>/process<i>.json``.
"""

from __future__ import annotations

import json
import os
import sys


def main(out_dir: str) -> None:
    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    me = jax.process_index()
    result: dict = {
        "process": me,
        "processes": jax.process_count(),
        "replicas": strategy.num_replicas_in_sync,
        "local_replicas": len(strategy.extended.worker_devices),
    }
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 5)).astype(np.float32)  # 100 rows: a partial last batch
    y = (x @ rng.normal(size=(5, 1))).astype(np.float32)

    # 1. ON_WRITE weights and ON_READ counters over a distributed dataset.
    with strategy.scope():
        w = jd.Variable(jnp.zeros((5, 1)), aggregation="mean", name="w")
        seen = jd.Variable(0.0, synchronization="on_read", aggregation="sum", name="seen")
        loss_sum = jd.Variable(0.0, synchronization="on_read", aggregation="sum", name="loss")

    @strategy.function
    def step(ctx, w, seen, loss_sum, batch):
        bx, by = batch
        mask = ctx.valid_mask(bx.shape[0])[:, None]
        total = ctx.global_num_valid.astype(jnp.float32)

        def loss_fn(v):
            return jnp.sum(jnp.where(mask, (bx @ v - by) ** 2, 0.0)) / total

        loss, g = jax.value_and_grad(loss_fn)(w.read_value())
        n = ctx.num_replicas_in_sync
        w = ctx.assign_sub(w, 0.1 * g * n)  # MEAN aggregation: n * mean = the global gradient
        seen = ctx.assign_add(seen, jnp.sum(mask).astype(jnp.float32))
        loss_sum = ctx.assign_add(loss_sum, loss * total)
        return w, seen, loss_sum

    ds = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=32))
    for _ in range(3):
        for batch in ds:
            w, seen, loss_sum = step(w, seen, loss_sum, batch)
    result["w"] = np.asarray(w.read_value()).ravel().tolist()
    result["seen"] = float(seen.read_value())
    result["loss_sum"] = float(loss_sum.read_value())

    # 2. A Flax NNX model with jd.train_step.
    with strategy.scope():
        model = nnx.Linear(5, 1, rngs=nnx.Rngs(0))
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

    # 3. One input pipeline per process.
    contexts = []

    def dataset_fn(ictx):
        contexts.append([ictx.num_input_pipelines, ictx.input_pipeline_id])
        rows = np.arange(64, dtype=np.float32)[ictx.input_pipeline_id :: ictx.num_input_pipelines]
        return jd.data.from_arrays(rows, batch_size=ictx.get_per_replica_batch_size(16))

    ids = []
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        gathered = strategy.gather(batch, axis=0)
        ids.extend(np.asarray(gathered).astype(int).tolist())
    result["pipelines"] = contexts
    result["pipeline_rows"] = ids

    # 4. Cross-replica API.
    per = strategy.run(lambda ctx: ctx.replica_id_in_sync_group * jnp.ones(2))
    result["local_results"] = [
        np.asarray(v).tolist() for v in strategy.experimental_local_results(per)
    ]
    result["reduce_sum"] = np.asarray(strategy.reduce("sum", per)).tolist()
    result["gather"] = np.asarray(strategy.gather(per, axis=0)).tolist()

    # 5. Checkpoint save (orbax, every process) and restore into fresh variables.
    ckpt = os.path.join(out_dir, "ckpt")
    jd.checkpoint.save(ckpt, {"w": w, "seen": seen})
    with strategy.scope():
        template = {
            "w": jd.Variable(jnp.ones((5, 1)), aggregation="mean", name="w"),
            "seen": jd.Variable(0.0, synchronization="on_read", aggregation="sum", name="seen"),
        }
    restored = jd.checkpoint.restore(ckpt, template)
    result["restored_w"] = np.asarray(restored["w"].read_value()).ravel().tolist()
    result["restored_seen"] = float(restored["seen"].read_value())

    with open(os.path.join(out_dir, f"process{me}.json"), "w") as f:
        json.dump(result, f)
    jd.cluster_resolver.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
