"""Training with `jd.fit` and a `PreemptionCheckpointHandler` that
tests/training/fit/test_preemption_hook.py preempts with SIGTERM, run through jaxdist's launcher.

An NNX model and its optimizer (updated in place) and a functional `jd.TrainState`
(returned), trained on each process's own shuffled data (``distribute_datasets_from_function``)
for EPOCHS epochs of 5 steps; `fit(..., resume=True, preemption_handler=handler)` with the
handler made with fit's `jd.training.Checkpoint` callback.

Usage: fit_preemption_training.py CKPT_DIR OUT_DIR [--epochs E] [--sleep SECONDS]
[--slow-after N,...]

Prints ``START <restart> <pid>`` before fit, ``STEP <global step>`` after every step, and at
the end writes ``OUT_DIR/final.<process>.npz`` (every array of the state, bit for bit, and
the history) and prints ``DONE <global step>``.
"""

from __future__ import annotations

import json
import os

from _preemption_job import arguments, make_state, pause, update  # beside this script


def main() -> None:
    args = arguments(epochs=6)

    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import numpy as np
    from flax import nnx

    def dataset_fn(ctx):  # type: ignore[no-untyped-def]
        rng = np.random.default_rng(10 + ctx.input_pipeline_id)
        x = rng.normal(size=(40, 4)).astype(np.float32)  # 4 replicas x 2 rows: 5 steps
        y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).astype(np.float32)
        return jd.data.from_arrays(x, y, batch_size=2, shuffle=True, seed=ctx.input_pipeline_id)

    model, optimizer, state = make_state(strategy)

    @jd.train_step(strategy)
    def train(ctx, model, optimizer, state, batch):  # type: ignore[no-untyped-def]
        state, loss = update(ctx, model, optimizer, state, *batch)
        return state, ctx.all_reduce("sum", loss)

    restart = os.environ.get("JAXDIST_RESTART_COUNT", "0")

    class Tell(jd.training.Callback):
        first = None  # the first step of this run

        def on_step_end(self, step, logs):  # type: ignore[no-untyped-def]
            print(f"STEP {step}", flush=True)
            self.first = step if self.first is None else self.first
            pause(args, int(restart), step - self.first + 1)

    ckpt = jd.training.Checkpoint(args.ckpt_dir, every_n_steps=4, keep=1)
    handler = jd.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, ckpt)
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
    speed = ("examples_per_second", "flops_per_step", "tflops_per_device")
    metrics = {k: v for k, v in history.history.items() if k not in speed}
    record = {"history": metrics, "epochs": history.epochs, "step": history.step}
    arrays["history"] = np.frombuffer(json.dumps(record).encode(), np.uint8)
    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"final.{jax.process_index()}.npz"), **arrays)
    print(f"DONE {history.step}", flush=True)


if __name__ == "__main__":
    main()
