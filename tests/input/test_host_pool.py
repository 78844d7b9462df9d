"""The prefetch thread's host buffers: a generator that refills one buffer still gives
every batch its own values (checked against the NumPy values it yielded), however long
the consumer keeps the batches, and the copies reuse buffers only when free."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.input.host_pool import ALIGNMENT, HostPool, aligned_empty

from _helpers import value


def _refilling(batches: int, rows: int = 64) -> object:
    """A generator that yields the same buffer every time, refilled with the batch index."""
    buf = np.zeros((rows, 16), np.float32)

    def gen():
        for i in range(batches):
            buf[:] = i
            yield buf

    return gen()


def test_aligned_empty_is_aligned_and_contiguous() -> None:
    for shape, dtype in [((8, 64, 784), np.float32), ((3,), np.int8), ((5, 7), np.float64)]:
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.ctypes.data % ALIGNMENT == 0


def test_pool_reuses_a_buffer_only_when_nothing_else_holds_it() -> None:
    pool = HostPool(per_shape=2)
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    first = pool.copy(src)
    np.testing.assert_array_equal(first, src)
    second = pool.copy(src + 1)  # `first` is held here: a new buffer
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, src)
    view = first[1:]
    first_address = first.ctypes.data
    del first
    third = pool.copy(src + 2)  # `first`'s buffer is still viewed, `second` held
    assert third.ctypes.data != first_address
    np.testing.assert_array_equal(view, src[1:])
    del view
    fourth = pool.copy(src + 3)  # the first buffer is free again
    assert fourth.ctypes.data == first_address
    np.testing.assert_array_equal(fourth, src + 3)
    np.testing.assert_array_equal(second, src + 1)
    np.testing.assert_array_equal(third, src + 2)


def test_pool_keeps_at_most_per_shape_buffers() -> None:
    pool = HostPool(per_shape=2)
    held = [pool.copy(np.full(4, i, np.float32)) for i in range(5)]  # all held: 5 buffers
    assert [float(h[0]) for h in held] == [0, 1, 2, 3, 4]
    assert len(pool._buffers[((4,), np.dtype(np.float32))]) == 2


def test_owned_copies_only_views() -> None:
    pool = HostPool(per_shape=2)
    own = np.ones(4, np.float32)
    view = np.ones((2, 4), np.float32)[0]
    leaves, _ = pool.owned(([own, view], np.array([1])))
    assert leaves[0] is own and leaves[1] is not view and leaves[1].flags.owndata is False
    assert leaves[1].base is not None and not np.shares_memory(leaves[1], view)


@pytest.mark.parametrize("keep", [True, False], ids=["batches-kept", "batches-dropped"])
def test_refilling_generator_keeps_every_batch(mirrored8: jd.MirroredStrategy, keep: bool) -> None:
    """40 batches from one refilled buffer: each placed batch (on CPU, a device buffer that
    may use the pool's host memory) keeps the value it was yielded with, whether the
    consumer keeps every batch (the pool runs out and allocates) or drops each one."""
    kept, means = [], []
    for batch in mirrored8.experimental_distribute_dataset(_refilling(40)):
        if keep:
            kept.append(batch)
        means.append(float(jnp.mean(batch.array)))
        gc.collect() if not keep and len(means) % 10 == 0 else None
    assert means == [float(i) for i in range(40)]
    if keep:
        assert [float(jnp.mean(b.array)) for b in kept] == [float(i) for i in range(40)]


def test_refilling_generator_with_a_step_that_donates_its_batch(
    mirrored8: jd.MirroredStrategy,
) -> None:
    """A step that donates the batch may write into its buffer: the next batches still
    hold their own values (the step's result is the batch mean plus one)."""
    step = mirrored8.function(
        lambda ctx, b: (b + 1.0, ctx.all_reduce("mean", jnp.mean(b + 1.0))),
        options=jd.RunOptions(donate_args=True),
    )
    outs = [step(b) for b in mirrored8.experimental_distribute_dataset(_refilling(20))]
    assert [float(value(mean)) for _, mean in outs] == [float(i) + 1.0 for i in range(20)]
    # The donated buffers' outputs stay intact after the pool has moved on.
    assert [float(np.mean(value(out))) for out, _ in outs] == [float(i) + 1.0 for i in range(20)]


def test_host_batches_handed_to_the_user_are_never_refilled(mirrored8: jd.MirroredStrategy) -> None:
    """With experimental_fetch_to_device=False the user holds the host arrays themselves."""
    opts = jd.InputOptions(experimental_fetch_to_device=False)
    kept = list(mirrored8.experimental_distribute_dataset(_refilling(30), opts))
    assert [float(np.mean(b.array)) for b in kept] == [float(i) for i in range(30)]


def test_device_copy_does_not_alias_a_refilled_source_on_cpu() -> None:
    """The pool's buffers are what JAX may wrap without copying on CPU; the source's own
    buffer never is, so refilling it cannot reach a placed batch."""
    s = jd.OneDeviceStrategy()
    buf = aligned_empty((64, 16), np.float32)
    buf[:] = 7

    def gen():
        yield buf
        buf[:] = -1
        yield buf

    first, second = (jax.device_get(b.array) for b in s.experimental_distribute_dataset(gen()))
    assert float(np.mean(first)) == 7.0 and float(np.mean(second)) == -1.0
