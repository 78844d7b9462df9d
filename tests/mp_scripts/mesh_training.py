"""A `MeshStrategy` job that tests/strategies/test_mesh_multi_process.py starts through
jaxdist's launcher: 2 processes x 4 devices, ``mesh_shape={"data": 1, "fsdp": 2,
"tensor": 2}, dcn_mesh_shape={"data": 2}``, so each process's 4 devices are one
(fsdp, tensor) block and ``data`` is the axis that crosses processes. The strategy
connects the processes itself (no ``jd.initialize()`` call), as
`MultiWorkerMirroredStrategy` does.

The loop is TF's preemption harness: driven by ``handler.total_run_calls`` of a
`PreemptionCheckpointHandler`, so a restarted job resumes at the step its checkpoint
holds. With ``--preempt-after K``, process 1 of the first attempt sends itself SIGTERM
after step K; the handler saves at the start of the next step in both processes and
exits with 42, and the launcher restarts the job.

Usage: mesh_training.py CKPT_DIR [--preempt-after K]

Prints ``START <restart> <mesh device owners as JSON> <total_run_calls>``, then
``LOSS <step> <loss>`` after each step, and at the end one JSON line: the number of
replicas and every state leaf's sum and sum of squares (gathered from both processes).
The test imports `make_state` and `train` from here and runs the same steps in one
process on an 8-device (2, 2, 2) mesh as the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

STEPS, BATCH = 8, 16


def make_state(strategy: Any) -> tuple[Any, Any]:
    """A one-layer decoder and its adamw optimizer, born sharded in ``strategy``'s scope."""
    import optax
    from flax import nnx

    from jaxdist.examples.gpt import Decoder

    with strategy.scope():
        model = Decoder(nnx.Rngs(0), layers=1)
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3, eps=1e-5), wrt=nnx.Param)
    return model, optimizer


def train(
    strategy: Any, model: Any, optimizer: Any, handler: Any = None, preempt_after: int = 0
) -> dict[int, float]:
    """Steps ``total_run_calls + 1 .. STEPS`` on fixed tokens (all of them without a
    handler); each step's loss by step, printed as ``LOSS <step> <loss>`` too. After step
    ``preempt_after`` (when not 0) this process sends itself SIGTERM."""
    import numpy as np
    import optax
    from flax import nnx

    import jaxdist as jd

    @jd.train_step(strategy)
    def step(ctx, model, optimizer, x, y):  # type: ignore[no-untyped-def]
        def loss(m):  # type: ignore[no-untyped-def]
            xent = optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean(-1)
            return jd.compute_average_loss(xent, global_batch_size=BATCH)

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", value)

    n = strategy.num_replicas_in_sync
    tokens = np.random.default_rng(0).integers(0, 64, size=(STEPS, BATCH, 9)).astype(np.int32)
    losses = {}
    done = handler.total_run_calls if handler is not None else 0
    for i in range(done, STEPS):
        x, y = tokens[i, :, :-1].reshape(n, -1, 8), tokens[i, :, 1:].reshape(n, -1, 8)
        xs, ys = strategy.experimental_distribute_values_from_function(
            lambda ctx, x=x, y=y: (x[ctx.replica_id_in_sync_group], y[ctx.replica_id_in_sync_group])
        )
        if handler is None:
            losses[i + 1] = float(step(model, optimizer, xs, ys))
        else:
            losses[i + 1] = float(handler.run(step, model, optimizer, xs, ys))
        print(f"LOSS {i + 1} {losses[i + 1]!r}", flush=True)
        if i + 1 == preempt_after:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler notices; the next run() saves
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("--preempt-after", type=int, default=0)
    args = parser.parse_args()

    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd
    from jaxdist.examples.gpt import RULES

    strategy = jd.experimental.MeshStrategy(
        {"data": 1, "fsdp": 2, "tensor": 2}, RULES, dcn_mesh_shape={"data": 2}
    )
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    owners = [sorted({d.process_index for d in block.flat}) for block in strategy.mesh.devices]
    model, optimizer = make_state(strategy)
    ckpt = jd.checkpoint.Checkpoint(model=model, optimizer=optimizer)
    handler = jd.experimental.PreemptionCheckpointHandler(None, ckpt, args.ckpt_dir)
    restart = int(os.environ.get("JAXDIST_RESTART_COUNT", "0"))
    print(f"START {restart} {json.dumps(owners)} {handler.total_run_calls}", flush=True)
    preempted = restart == 0 and jax.process_index() == 1
    train(strategy, model, optimizer, handler, args.preempt_after if preempted else 0)
    leaves = [
        np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float64)
        for x in jax.tree.leaves(nnx.state(model))
    ]
    print(json.dumps({
        "replicas": strategy.num_replicas_in_sync,
        "sums": [float(x.sum()) for x in leaves],
        "squares": [float((x * x).sum()) for x in leaves],
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
