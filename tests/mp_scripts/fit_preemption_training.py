"""Training with `jd.fit` and a `PreemptionCheckpointHandler` that tests/test_fit_preemption.py
preempts with SIGTERM, run through jaxdist's launcher.

An NNX model and its optimizer (updated in place) and a functional `jd.TrainState`
(returned), trained on each process's own shuffled data (``distribute_datasets_from_function``)
for EPOCHS epochs of 5 steps; `fit(..., resume=True, preemption_handler=handler)` with the
handler made with fit's `jd.training.Checkpoint` callback.

Usage: fit_preemption_training.py CKPT_DIR OUT_DIR [--epochs E] [--sleep SECONDS]

Prints ``START <restart> <pid>`` before fit, ``STEP <global step>`` after every step, and at
the end writes ``OUT_DIR/final.<process>.npz`` (every array of the state, bit for bit, and
the history) and prints ``DONE <global step>``.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()

    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    def dataset_fn(ctx):  # type: ignore[no-untyped-def]
        rng = np.random.default_rng(10 + ctx.input_pipeline_id)
        x = rng.normal(size=(40, 4)).astype(np.float32)  # 4 replicas x 2 rows: 5 steps
        y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).astype(np.float32)
        return jd.data.from_arrays(x, y, batch_size=2, shuffle=True, seed=ctx.input_pipeline_id)

    with strategy.scope():
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
        state = jd.TrainState.create(
            apply_fn=None, params={"w": jnp.zeros(4), "b": jnp.zeros(())},
            tx=optax.sgd(0.05, momentum=0.9),
        )  # fmt: skip

    @jd.train_step(strategy)
    def train(ctx, model, optimizer, state, batch):  # type: ignore[no-untyped-def]
        bx, by = batch

        def nnx_loss(model):  # type: ignore[no-untyped-def]
            return jd.compute_average_loss((model(bx)[:, 0] - by) ** 2)

        def fn_loss(params):  # type: ignore[no-untyped-def]
            return jd.compute_average_loss((bx @ params["w"] + params["b"] - by) ** 2)

        loss, grads = nnx.value_and_grad(nnx_loss)(model)
        optimizer.update(model, ctx.all_reduce("sum", grads))
        grads = ctx.all_reduce("sum", jax.grad(fn_loss)(state.params))
        return state.apply_gradients(grads=grads), ctx.all_reduce("sum", loss)

    class Tell(jd.training.Callback):
        def on_step_end(self, step, logs):  # type: ignore[no-untyped-def]
            print(f"STEP {step}", flush=True)
            time.sleep(args.sleep)

    ckpt = jd.training.Checkpoint(args.ckpt_dir, every_n_steps=4, keep=1)
    handler = jd.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, ckpt)
    restart = os.environ.get("JAXDIST_RESTART_COUNT", "0")
    print(f"START {restart} {os.getpid()}", flush=True)
    data = strategy.distribute_datasets_from_function(dataset_fn)
    state, history = jd.fit(
        train, model, optimizer, state, data=data, epochs=args.epochs, callbacks=[Tell()],
        verbose=False, resume=True, preemption_handler=handler,
    )  # fmt: skip
    arrays = {
        f"leaf{i}": np.asarray(leaf)
        for i, leaf in enumerate(jax.tree.leaves([nnx.state(model), nnx.state(optimizer), state]))
    }
    record = {"history": history.history, "epochs": history.epochs, "step": history.step}
    arrays["history"] = np.frombuffer(json.dumps(record).encode(), np.uint8)
    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"final.{jax.process_index()}.npz"), **arrays)
    print(f"DONE {history.step}", flush=True)


if __name__ == "__main__":
    main()
