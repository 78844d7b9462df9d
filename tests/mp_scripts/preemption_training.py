"""Training that tests/experimental/preemption/test_preemption.py preempts with SIGTERM, run
through jaxdist's launcher.

TF's harness (failure_handler_test.py): EPOCHS epochs of STEPS steps, the loop
driven by ``handler.total_run_calls``, so that a restarted job resumes at the
step the checkpoint holds. The state covers every kind a checkpoint takes: an
NNX model and its optimizer (restored in place), a functional `jd.TrainState`
and an ``ON_READ`` SUM counter (rebound after each step), and the data
iterator's position (each process its own).

Usage: preemption_training.py CKPT_DIR OUT_DIR [--epochs E] [--steps S] [--sleep SECONDS]
[--slow-after N,...]

Prints ``START <restart> <pid> <total_run_calls>`` once the handler has
restored, ``STEP <total_run_calls>`` after every step, and at the end writes
``OUT_DIR/final.<process>.npz`` (every array of the state, bit for bit) and
prints ``DONE <total_run_calls>``.
"""

from __future__ import annotations

import os

from _preemption_job import arguments, make_state, pause, update  # beside this script


def main() -> None:
    args = arguments(epochs=8, steps=15)

    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import numpy as np
    from flax import nnx

    batch, steps, epochs = 16, args.steps, args.epochs
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).astype(np.float32)
    dataset = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(x, y, batch_size=batch, shuffle=True, seed=1)
    )

    model, optimizer, state = make_state(strategy)
    with strategy.scope():
        seen = jd.Variable(0, synchronization="on_read", aggregation="sum")

    @jd.train_step(strategy)
    def train(ctx, model, optimizer, state, seen, batch):  # type: ignore[no-untyped-def]
        bx, by = batch
        state, loss = update(ctx, model, optimizer, state, bx, by)
        return state, ctx.assign_add(seen, bx.shape[0]), loss

    iterator = iter(dataset)
    ckpt = jd.checkpoint.Checkpoint(
        model=model, optimizer=optimizer, state=state, seen=seen, data=iterator
    )
    handler = jd.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, ckpt, args.ckpt_dir
    )
    restart = os.environ.get("JAXDIST_RESTART_COUNT", "0")
    resumed = handler.total_run_calls
    print(f"START {restart} {os.getpid()} {resumed}", flush=True)

    def step(it):  # type: ignore[no-untyped-def]
        ckpt.state, ckpt.seen, loss = train(model, optimizer, ckpt.state, ckpt.seen, next(it))
        return loss

    for _ in range(handler.total_run_calls // steps, epochs):
        if handler.total_run_calls % steps == 0 and handler.total_run_calls:
            iterator = ckpt.data = iter(dataset)  # a new epoch (the restored one had ended)
        for _ in range(handler.total_run_calls % steps, steps):
            handler.run(step, iterator)
            print(f"STEP {handler.total_run_calls}", flush=True)
            pause(args, int(restart), handler.total_run_calls - resumed)

    arrays = {
        f"leaf{i}": np.asarray(leaf)
        for i, leaf in enumerate(
            jax.tree.leaves([nnx.state(model), nnx.state(optimizer), ckpt.state])
        )
    }
    arrays["seen"] = np.asarray(ckpt.seen.read_value())
    arrays["data_state"] = np.frombuffer(repr(iterator.get_state()).encode(), np.uint8)
    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"final.{jax.process_index()}.npz"), **arrays)
    print(f"DONE {handler.total_run_calls}", flush=True)


if __name__ == "__main__":
    main()
