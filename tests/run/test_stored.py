"""A stored leaf's block of a sum, taken before a transpose: the same values as after it.

`jaxdist._run.sliced_eval` reduce-scatters a gradient that autodiff transposes
(the kernel gradient of ``x @ w``) before the transpose, with the layout
`jaxdist._run.stored.transposed` gives, and transposes the block. Checked here
against the block of the transposed sum in NumPy, on 8 simulated devices.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._run.stored import scatter_sum, stored, transposed

AXES = ("data", "fsdp")


@pytest.mark.parametrize(
    ("spec", "permutation"),
    [
        (P("fsdp", None), (1, 0)),
        (P(None, "fsdp"), (1, 0)),
        (P(None, ("data", "fsdp")), (1, 0)),
        (P(None, "fsdp", None), (2, 0, 1)),
        (P("fsdp"), (0, 2, 1)),
    ],
)
def test_the_block_of_a_transposed_sum_is_the_transposed_block(
    spec: P, permutation: tuple[int, ...]
) -> None:
    mesh = jax.make_mesh((2, 4), AXES, devices=jax.devices()[:8])
    sizes = dict(mesh.shape)
    layout = stored(spec, mesh, AXES)
    assert layout is not None
    shape = (8, 16, 24)[: len(permutation)]  # y's shape; its transpose is the stored leaf
    rng = np.random.default_rng(0)
    per_device = rng.normal(size=(8, *shape)).astype(np.float32)
    inputs = jax.device_put(per_device, NamedSharding(mesh, P(AXES)))

    def by_transposed_layout(y: jax.Array) -> jax.Array:
        block = scatter_sum(y[0], transposed(layout, permutation), AXES)
        return lax.transpose(block, permutation)[None]

    def after_the_transpose(y: jax.Array) -> jax.Array:
        return scatter_sum(lax.transpose(y[0], permutation), layout, AXES)[None]

    total = np.transpose(per_device.sum(axis=0), permutation)
    for fn in (by_transposed_layout, after_the_transpose):
        run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))
        blocks = np.asarray(run(inputs))
        for device, block in enumerate(blocks):
            index = dict(zip(AXES, np.unravel_index(device, (2, 4)), strict=True))
            want = total
            for d, axes, count in layout.cut:
                position = np.ravel_multi_index([index[a] for a in axes], [sizes[a] for a in axes])
                size = total.shape[d] // count
                want = np.take(want, range(position * size, (position + 1) * size), axis=d)
            np.testing.assert_allclose(block, want, rtol=1e-5, atol=1e-5)


def test_transposed_moves_every_part_of_the_layout() -> None:
    mesh = jax.make_mesh((2, 4), AXES, devices=jax.devices()[:8])
    layout = stored(P("fsdp", None, "data"), mesh, AXES)
    assert layout is not None
    moved = transposed(layout, (2, 0, 1))
    assert moved.spec == P(None, "data", "fsdp")
    assert moved.manual == P(None, "data", "fsdp")
    assert moved.cut == ((2, ("fsdp",), 4), (1, ("data",), 2))
    assert moved.auto is None
