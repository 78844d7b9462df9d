"""`MeshStrategy` across processes: 2 processes x 4 devices with ``dcn_mesh_shape``.

``mesh_shape={"data": 1, "fsdp": 2, "tensor": 2}, dcn_mesh_shape={"data": 2}``:
each process's 4 devices are one (fsdp, tensor) block, and ``data`` is the axis
that crosses processes. Three adamw steps of the GPT-2-style decoder equal the
one-process run of the same (2, 2, 2) mesh on 8 devices (losses and every leaf's
sum and sum of squares, rtol 1e-5), which the other mesh tests hold to one device.
"""

from __future__ import annotations

import inspect

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd
from jaxdist.examples.gpt import Decoder, mesh_strategy

from _helpers import run_workers, worker_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, BATCH = 3, 16

BODY = """
import numpy as np, optax
from flax import nnx
from jax.experimental import multihost_utils
import jaxdist as jd
from jaxdist.examples.gpt import RULES, Decoder

strategy = jd.experimental.MeshStrategy(
    {"data": 1, "fsdp": 2, "tensor": 2}, RULES, dcn_mesh_shape={"data": 2}
)
owners = [sorted({d.process_index for d in block.flat}) for block in strategy.mesh.devices]
with strategy.scope():
    model = Decoder(nnx.Rngs(0), layers=1)
    opt = nnx.Optimizer(model, optax.adamw(3e-3, eps=1e-5), wrt=nnx.Param)
losses = train(strategy, model, opt)
leaves = [np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float64)
          for x in jax.tree.leaves(nnx.state(model))]
print(json.dumps({
    "owners": owners, "losses": losses, "replicas": strategy.num_replicas_in_sync,
    "sums": [float(x.sum()) for x in leaves], "squares": [float((x * x).sum()) for x in leaves],
}))
"""


def train(strategy: jd.Strategy, model: Decoder, opt: nnx.Optimizer) -> list[float]:
    """Three adamw steps on fixed tokens; the losses (also run in each worker)."""

    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):  # type: ignore[no-untyped-def]
        def loss(m):  # type: ignore[no-untyped-def]
            xent = optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean(-1)
            return jd.compute_average_loss(xent, global_batch_size=BATCH)

        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", value)

    n = strategy.num_replicas_in_sync
    tokens = np.random.default_rng(0).integers(0, 64, size=(STEPS, BATCH, 9)).astype(np.int32)
    losses = []
    for batch in tokens:
        x, y = batch[:, :-1].reshape(n, -1, 8), batch[:, 1:].reshape(n, -1, 8)
        xs, ys = strategy.experimental_distribute_values_from_function(
            lambda ctx, x=x, y=y: (x[ctx.replica_id_in_sync_group], y[ctx.replica_id_in_sync_group])
        )
        losses.append(float(step(model, opt, xs, ys)))
    return losses


def _worker_code() -> str:
    source = inspect.getsource(train)
    header = "import optax\nimport jaxdist as jd\nfrom flax import nnx\nimport numpy as np\n"
    header += "from jaxdist.examples.gpt import Decoder\nSTEPS, BATCH = 3, 16\n"
    return worker_script(header + source + BODY)


def test_two_processes_with_a_dcn_data_axis_train_equal_to_one_process() -> None:
    two = run_workers(_worker_code(), processes=2, timeout=500)
    strategy = mesh_strategy((2, 2, 2))
    with strategy.scope():
        model = Decoder(nnx.Rngs(0), layers=1)
        opt = nnx.Optimizer(model, optax.adamw(3e-3, eps=1e-5), wrt=nnx.Param)
    losses = train(strategy, model, opt)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(nnx.state(model))]
    for r in two:
        assert r["owners"] == [[0], [1]]  # data index d lives on process d: data crosses
        assert r["replicas"] == 4
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["sums"], [x.sum() for x in leaves], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            r["squares"], [(x * x).sum() for x in leaves], rtol=1e-5, atol=1e-6
        )
