"""Results of padded partial batches leave the padding out.

A distributed dataset pads a partial last batch with zero rows. The outputs of such a
batch carry its valid rows (through copies and pickles too), so reduce, gather and the
local results see the data rows alone (NumPy reference, rtol 1e-6). On data of one
sign, a zero that leaks into a MAX (all-negative data) or a MIN (all-positive
data) wins, so each reduction runs on both signs and on floats and integers, and
is compared with NumPy over the data rows alone.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _helpers import strategy_params

ROWS, BATCH = 21, 8  # batches of 8, 8 and 5 rows: with 8 replicas, 3 hold only padding
OPS: dict[str, Callable[..., np.ndarray]] = {"max": np.max, "min": np.min}


def _data(sign: str, dtype: Any, rows: int = ROWS) -> np.ndarray:
    """``rows`` x 2 values of one sign, away from zero, distinct, in no sorted order."""
    base = (np.arange(rows * 2).reshape(rows, 2) * 7) % (rows * 2) + 3
    return (base if sign == "positive" else -base).astype(dtype)


def _strategies() -> list[Any]:
    return strategy_params("one_device", "mirrored2", "mirrored8")


def _every_case(test: Any) -> Any:
    """Parametrizes ``test`` over the strategies (``make``), both signs and both dtypes."""
    test = pytest.mark.parametrize("dtype", [np.float32, np.int32])(test)
    test = pytest.mark.parametrize("sign", ["negative", "positive"])(test)
    return pytest.mark.parametrize("make", _strategies())(test)


def _batches(s: jd.Strategy, *arrays: np.ndarray) -> list[Any]:
    ds = s.experimental_distribute_dataset(jd.data.from_arrays(*arrays, batch_size=BATCH))
    batches = list(ds)
    assert len(batches) == 3
    return batches


def _rows(data: np.ndarray, i: int) -> np.ndarray:
    return data[i * BATCH : (i + 1) * BATCH]


def _fill(op: str, dtype: Any) -> Any:
    """The value that never wins ``op`` (the user's side of a masked reduction)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if op == "max" else jnp.inf
    info = jnp.iinfo(dtype)
    return info.min if op == "max" else info.max


@_every_case
def test_reduce_along_the_batch_leaves_padding_out(make, sign: str, dtype: Any) -> None:
    s = make()
    data = _data(sign, dtype)
    for i, batch in enumerate(_batches(s, data)):
        if i == 2 and s.num_replicas_in_sync > 1:
            assert int(np.sum(np.asarray(batch.valid))) == ROWS - 2 * BATCH
        for op, f in OPS.items():
            out = np.asarray(s.reduce(op, batch, axis=0))
            assert out.dtype == dtype
            np.testing.assert_array_equal(out, f(_rows(data, i), axis=0), err_msg=f"{op} {i}")


@pytest.mark.parametrize("make", _strategies())
@pytest.mark.parametrize("sign", ["negative", "positive"])
def test_reduce_of_a_padded_tuple_batch_in_one_call(make, sign: str) -> None:
    # Several leaves of one padded batch (one set of valid counts), reduced together.
    s = make()
    x, y = _data(sign, np.float32), _data(sign, np.int32)[:, 0]
    for i, (bx, by) in enumerate(_batches(s, x, y)):
        for op, f in OPS.items():
            out = s.reduce(op, {"x": bx, "y": by}, axis=0)
            np.testing.assert_array_equal(np.asarray(out["x"]), f(_rows(x, i), axis=0))
            assert int(out["y"]) == int(f(_rows(y, i)))


@pytest.mark.parametrize("make", _strategies())
@pytest.mark.parametrize("sign", ["negative", "positive"])
def test_outputs_computed_from_a_partial_batch_reduce_without_padding(make, sign: str) -> None:
    # run's per-replica outputs inherit the batch's valid counts; their padding rows hold
    # whatever fn computed from the zero rows (here 0 * 3 = 0 and 0 - 0 = 0).
    s = make()
    data = _data(sign, np.float32)

    def fn(ctx, b):
        return {"scaled": b * 3.0, "diff": b - b[:, ::-1]}

    for i, batch in enumerate(_batches(s, data)):
        out = s.run(fn, args=(batch,))
        rows = _rows(data, i)
        for op, f in OPS.items():
            got = s.reduce(op, out, axis=0)
            np.testing.assert_array_equal(np.asarray(got["scaled"]), f(rows * 3.0, axis=0))
            np.testing.assert_array_equal(np.asarray(got["diff"]), f(rows - rows[:, ::-1], axis=0))


@_every_case
def test_all_reduce_of_masked_batches_in_the_replica(make, sign: str, dtype: Any) -> None:
    # Inside the replica: valid_mask leaves this replica's padding out (a replica holding
    # only padding contributes the identity), then all_reduce takes MAX/MIN across replicas.
    s = make()
    data = _data(sign, dtype)

    def fn(ctx, b):
        mask = ctx.valid_mask(b.shape[0])[:, None]
        out = {}
        for op in OPS:
            local = jnp.where(mask, b, jnp.asarray(_fill(op, b.dtype), b.dtype))
            out[op] = ctx.all_reduce(op, jnp.max(local, 0) if op == "max" else jnp.min(local, 0))
        return out

    for i, batch in enumerate(_batches(s, data)):
        out = s.run(fn, args=(batch,))
        for op, f in OPS.items():
            if s.num_replicas_in_sync > 1:
                assert isinstance(out[op], jd.Mirrored)
            got = np.asarray(out[op].array if isinstance(out[op], jd.Mirrored) else out[op])
            np.testing.assert_array_equal(got, f(_rows(data, i), axis=0), err_msg=f"{op} {i}")


@pytest.mark.parametrize("sign", ["negative", "positive"])
def test_per_replica_batches_from_a_dataset_fn(sign: str) -> None:
    # distribute_datasets_from_function: the last step has one replica without a batch.
    s = jd.MirroredStrategy(jax.devices()[:2])
    data = _data(sign, np.float32, rows=10)

    def dataset_fn(ctx):
        return jd.data.from_arrays(data, batch_size=2)

    steps = list(s.distribute_datasets_from_function(dataset_fn))
    assert len(steps) == 3 and steps[-1].valid.tolist() == [2, 0]
    for i, step in enumerate(steps):
        rows = data[4 * i : 4 * i + 4]
        for op, f in OPS.items():
            np.testing.assert_array_equal(np.asarray(s.reduce(op, step, axis=0)), f(rows, 0))


@pytest.mark.parametrize("sign", ["negative", "positive"])
@pytest.mark.parametrize("axis", [None, 1, -1])
def test_reduce_across_replicas_or_along_another_axis_leaves_padding_out(
    sign: str, axis: int | None
) -> None:
    """``reduce`` with ``axis=None`` (across replicas, position by position) or along a
    feature axis: only each replica's valid rows take part; a position that is padding on
    every replica gives NumPy's reduction of nothing. Reference: NumPy masked arrays."""
    s = jd.MirroredStrategy(jax.devices()[:2])
    data = _data(sign, np.float32, rows=13)  # batches of 8 and 5 (4 rows per replica)
    ds = s.experimental_distribute_dataset(jd.data.from_arrays(data, batch_size=8))
    *_, last = list(ds)
    rows = np.asarray(last.array)  # (replicas, rows, 2), padding included
    valid = np.asarray(last.valid)
    assert valid.tolist() == [3, 2]  # row 3 is padding on both replicas
    mask = np.arange(rows.shape[1])[None, :, None] >= valid[:, None, None]
    masked = np.ma.masked_array(rows, np.broadcast_to(mask, rows.shape))
    axes = (0,) if axis is None else (0, axis % 2 + 1)
    fills = {"sum": 0.0, "mean": np.nan, "max": -np.inf, "min": np.inf}
    for op in ("sum", "mean", "max", "min"):
        want = getattr(masked, op)(axis=axes).filled(fills[op])
        got = np.asarray(s.reduce(op, last, axis=axis))
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{op} axis={axis}")


def _last_batch(strategy: jd.Strategy, x: np.ndarray) -> Any:
    """The last, partial distributed batch of ``x`` at global batch 32."""
    ds = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=32))
    return list(ds)[-1]


@pytest.mark.parametrize("n", [1, 8])
def test_the_last_partial_batch_alone_matches_numpy(n: int) -> None:
    s = jd.MirroredStrategy(jax.devices()[:n])
    x = np.random.default_rng(1).normal(size=(100, 3)).astype(np.float32)
    out = s.run(lambda ctx, b: b * 2.0 + 1.0, args=(_last_batch(s, x),))
    tail = x[96:] * 2 + 1  # the 4 rows of the last batch, padded to 32 on the replicas
    np.testing.assert_allclose(s.reduce("mean", out, axis=0), tail.mean(0), rtol=1e-6)
    np.testing.assert_allclose(s.reduce("sum", out, axis=0), tail.sum(0), rtol=1e-6)
    np.testing.assert_allclose(s.reduce("max", out, axis=0), tail.max(0), rtol=1e-6)
    np.testing.assert_allclose(s.gather(out, axis=0), tail, rtol=1e-6)
    # Copies and pickles keep the valid-row counts.
    for again in (copy.deepcopy(out), _pickled(s, out)):
        np.testing.assert_allclose(s.gather(again, axis=0), tail, rtol=1e-6)
        np.testing.assert_allclose(
            np.concatenate(s.experimental_local_results(again)), tail, rtol=1e-6
        )


def _pickled(strategy: jd.Strategy, value: Any) -> Any:
    with strategy.scope():
        return pickle.loads(pickle.dumps(value))


@pytest.mark.parametrize("n", [1, 2, 8])
def test_outputs_of_padded_batches_carry_their_valid_rows(n: int) -> None:
    s = jd.MirroredStrategy(jax.devices()[:n])
    x = np.random.default_rng(0).normal(size=(100, 3)).astype(np.float32)
    ds = s.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=32))
    step = s.function(lambda ctx, b: b * 2.0 + 1.0)  # per-example outputs, padded rows too
    gathered, means = [], []
    for batch in ds:
        out = step(batch)
        gathered.append(np.asarray(s.gather(out, axis=0)))
        means.append((np.asarray(s.reduce("mean", out, axis=0)), len(gathered[-1])))
    np.testing.assert_allclose(np.concatenate(gathered), x * 2 + 1, rtol=1e-6)
    total = sum(m * k for m, k in means) / 100
    np.testing.assert_allclose(total, (x * 2 + 1).mean(axis=0), rtol=1e-5)
    local = np.concatenate(
        [np.concatenate(s.experimental_local_results(step(b))) for b in ds], axis=0
    )
    np.testing.assert_allclose(local, x * 2 + 1, rtol=1e-6)
