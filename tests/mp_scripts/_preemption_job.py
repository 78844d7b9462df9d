"""What the two preemption scripts share (a module beside them, not a script): their
command line, and the state they train and checkpoint, an NNX linear model with its
optimizer and a functional `jd.TrainState` of the same model.

JAX and the libraries on it are imported inside the functions: a script makes its
strategy (which starts ``jax.distributed``) before it builds the state.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def arguments(epochs: int, steps: int | None = None) -> argparse.Namespace:
    """``CKPT_DIR OUT_DIR [--epochs E] [--steps S] [--sleep SECONDS] [--slow-after N,...]``
    (``--steps`` only when the script has a default for it; ``--slow-after``: `pause`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=epochs)
    if steps is not None:
        parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--slow-after", default="")
    return parser.parse_args()


def pause(args: argparse.Namespace, restart: int, steps_in_run: int) -> None:
    """The wait after a step: ``--sleep`` seconds, and from step ``N_r`` of the job's run
    ``r`` on (``--slow-after N_0,N_1,...``, steps counted from the run's start) 1 s more,
    so that a test's signal sent when it reads that step's line lands while the job still
    has steps to run, however late the line reaches the test on a loaded machine."""
    slow = [int(n) for n in args.slow_after.split(",") if n]
    late = restart < len(slow) and steps_in_run >= slow[restart]
    time.sleep(args.sleep + (1.0 if late else 0.0))


def make_state(strategy: Any) -> tuple[Any, Any, Any]:
    """The model, its optimizer (updated in place) and the functional state (returned),
    made in ``strategy``'s scope."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxdist as jd

    with strategy.scope():
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
        state = jd.TrainState.create(
            apply_fn=None, params={"w": jnp.zeros(4), "b": jnp.zeros(())},
            tx=optax.sgd(0.05, momentum=0.9),
        )  # fmt: skip
    return model, optimizer, state


def update(ctx: Any, model: Any, optimizer: Any, state: Any, bx: Any, by: Any) -> tuple[Any, Any]:
    """One step of both on the batch ``(bx, by)`` (squared error, gradients all-reduced):
    the new functional state, and this replica's share of the model's loss."""
    import jax
    from flax import nnx

    import jaxdist as jd

    def nnx_loss(model):  # type: ignore[no-untyped-def]
        return jd.compute_average_loss((model(bx)[:, 0] - by) ** 2)

    def fn_loss(params):  # type: ignore[no-untyped-def]
        return jd.compute_average_loss((bx @ params["w"] + params["b"] - by) ** 2)

    loss, grads = nnx.value_and_grad(nnx_loss)(model)
    optimizer.update(model, ctx.all_reduce("sum", grads))
    grads = ctx.all_reduce("sum", jax.grad(fn_loss)(state.params))
    return state.apply_gradients(grads=grads), loss
