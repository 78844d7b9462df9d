"""The core-hardening issue, audited item by item: the tests that were missing or weak.

Each test names the issue section it holds the code to. References are NumPy (or
plain JAX); float tolerance rtol=1e-6 unless stated, small integers compare exactly.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxdist as jd

# 2. Results that stay right with padding -----------------------------------------------


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


# 4. Values and variables that behave like arrays ---------------------------------------


@pytest.mark.parametrize("initial", [0.0, 0, [0.0, 1.0]])
def test_first_updates_do_not_retrace_under_a_user_jit(initial: Any) -> None:
    v = jd.Variable(initial)
    traces = []

    @jax.jit
    def step(v: jd.Variable) -> jd.Variable:
        traces.append(1)
        return v.assign_add(1).assign_sub(0)

    for _ in range(3):
        v = step(v)
    v = v.assign(2)  # a Python int, eagerly: the variable keeps its strong dtype
    v = step(v)
    assert len(traces) == 1
    assert not v.device_values.weak_type and v.dtype == jnp.asarray(np.asarray(initial)).dtype
    np.testing.assert_array_equal(v.read_value(), np.full(np.shape(initial), 3))


@pytest.mark.parametrize("sync", ["on_write", "on_read"])
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_updates_inside_a_user_jit_keep_the_placement(sync: str, method: str) -> None:
    s = jd.MirroredStrategy()
    with s.scope():
        v = jd.Variable(jnp.zeros(2), synchronization=sync, aggregation="mean")
    out = jax.jit(lambda v, x: getattr(v, method)(x))(v, jnp.ones(2))  # x: uncommitted
    expected = {"assign": 1.0, "assign_add": 1.0, "assign_sub": -1.0}[method]
    np.testing.assert_array_equal(out.read_value(), [expected] * 2)
    sharding = out.device_values.sharding
    assert sharding.device_set == set(jax.devices())  # every replica's copy, not one device
    assert sharding.is_equivalent_to(v.device_values.sharding, v.device_values.ndim)
    assert sharding.spec == (P() if sync == "on_write" else P("replica"))


@pytest.mark.parametrize("make", [jd.OneDeviceStrategy, None], ids=["one_device", "default"])
def test_on_read_without_aggregation_on_one_replica_reads_its_copy(make: Any) -> None:
    s = make() if make is not None else jd.get_strategy()
    with s.scope():
        v = jd.Variable(jnp.zeros(2), synchronization="on_read")  # aggregation NONE
    v = s.run(lambda ctx, v: ctx.assign_add(v, jnp.array([1.0, 2.0])), args=(v,))
    np.testing.assert_array_equal(v.read_value(), [1.0, 2.0])  # TF: a plain variable
    np.testing.assert_array_equal(np.asarray(v), [1.0, 2.0])
    saved = jd.checkpoint.to_saveable({"v": v})
    np.testing.assert_array_equal(saved["v"], [1.0, 2.0])


def test_per_replica_has_no_truth_value(mirrored8: jd.MirroredStrategy) -> None:
    out = mirrored8.run(lambda ctx: ctx.replica_id_in_sync_group)
    with pytest.raises(TypeError, match=r"no single truth value.*strategy.reduce"):
        bool(out)


# 5. Checkpoints that refuse the wrong thing ----------------------------------------------


def _leaf(kind: str, strategy: jd.Strategy, dtype: Any) -> Any:
    """A template leaf of shape (3,) (a Python number: shape ()) of ``kind``."""
    zeros = np.zeros(3, dtype)
    with strategy.scope():
        if kind == "variable":
            return jd.Variable(zeros, aggregation="mean", name="t")
        if kind == "on_read_sum":
            return jd.Variable(zeros, synchronization="on_read", aggregation="sum", name="t")
    if kind == "per_replica":
        return strategy.experimental_distribute_values_from_function(lambda ctx: zeros[:1])
    if kind == "mirrored":
        return jd.Mirrored(jnp.asarray(zeros))
    if kind == "jax_array":
        return jnp.asarray(zeros)
    if kind == "numpy":
        return zeros
    return 0 if np.dtype(dtype).kind == "i" else 0.0


LEAF_KINDS = ["variable", "on_read_sum", "per_replica", "mirrored", "jax_array", "numpy", "python"]


@pytest.mark.parametrize("kind", LEAF_KINDS)
def test_from_saveable_checks_every_kind_of_leaf(kind: str) -> None:
    s = jd.MirroredStrategy()
    n = s.num_replicas_in_sync
    template = {"opt": [{"t": _leaf(kind, s, np.int32)}]}
    shape = {"per_replica": (n, 1), "python": ()}.get(kind, (3,))
    wrong = (n, 2) if kind == "per_replica" else (4, 3)
    with pytest.raises(
        ValueError,
        match=rf"from_saveable: \['opt'\]\[0\]\['t'\] has shape {re_shape(wrong)} in the "
        rf"checkpoint, but .* has shape {re_shape(shape)}\..* Restore into a template",
    ):
        jd.checkpoint.from_saveable({"opt": [{"t": np.zeros(wrong, np.int32)}]}, template)
    with pytest.raises(
        ValueError,
        match=r"from_saveable: \['opt'\]\[0\]\['t'\] is float64 in the checkpoint, but .* is "
        r"int(32|64): a cast from floating point to an integer drops the fraction. Convert",
    ):
        jd.checkpoint.from_saveable({"opt": [{"t": np.full(shape, 2.5)}]}, template)
    back = jd.checkpoint.from_saveable({"opt": [{"t": np.full(shape, 7, np.int64)}]}, template)
    leaf = back["opt"][0]["t"]
    value = leaf.read_value() if isinstance(leaf, jd.Variable) else leaf
    value = value.array if isinstance(value, jd.DistributedValues) else value
    np.testing.assert_array_equal(np.asarray(value), np.full(shape, 7))


def re_shape(shape: tuple[int, ...]) -> str:
    """A shape as the regular expression of its repr."""
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_restore_from_files_refuses_wrong_dtypes_and_replica_counts(tmp_path: Any) -> None:
    pytest.importorskip("orbax.checkpoint")
    s8, s4 = jd.MirroredStrategy(), jd.MirroredStrategy(jax.devices()[:4])
    rows = s8.experimental_distribute_values_from_function(
        lambda ctx: np.full(3, ctx.replica_id_in_sync_group, np.float32)
    )
    with s8.scope():
        copies = jd.Variable(np.zeros(3, np.float32), synchronization="on_read", aggregation="sum")
    state = {"rows": rows, "count": np.float64(2.5), "copies": copies.device_values}
    jd.checkpoint.save(tmp_path / "ckpt", state)

    def template(strategy: jd.Strategy, **changes: Any) -> dict:
        with strategy.scope():
            t = {
                "rows": rows,
                "count": jd.Variable(0.0, name="count"),
                "copies": jnp.zeros((8, 3)),
            }
        return {**t, **changes}

    with s4.scope():
        count = jd.Variable(0, name="count")
        on_read = jd.Variable(np.zeros(3, np.float32), synchronization="on_read", name="c")
    with pytest.raises(
        ValueError,
        match=r"restore: \['count'\] is float64 in the checkpoint, but variable 'count' is "
        r"int32: a cast from floating point to an integer drops the fraction",
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", template(s8, count=count))
    four = s4.experimental_distribute_values_from_function(lambda ctx: np.zeros(3, np.float32))
    with pytest.raises(
        ValueError,
        match=r"restore: \['rows'\] holds 8 per-replica values \(shape \(8, 3\)\) in the "
        r"checkpoint, but the template's PerReplica has 4 replicas \(shape \(4, 3\)\)",
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", template(s8, rows=four))
    with pytest.raises(
        ValueError,
        match=r"restore: \['copies'\] has shape \(8, 3\) in the checkpoint, but variable 'c' "
        r"has shape \(3,\). It looks like 8 per-replica copies: save the variable itself",
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", template(s8, copies=on_read))
    out = jd.checkpoint.restore(tmp_path / "ckpt", template(s8))
    assert float(out["count"].read_value()) == 2.5
    np.testing.assert_array_equal(out["rows"].array, np.repeat(np.arange(8.0)[:, None], 3, 1))


def test_string_leaves_restore_only_into_strings() -> None:
    saved = jd.checkpoint.to_saveable({"act": "relu", "step": 3})
    back = jd.checkpoint.from_saveable(saved, {"act": "tanh", "step": 0})
    assert back == {"act": "relu", "step": 3} and type(back["act"]) is str
    with pytest.raises(
        ValueError,
        match=r"from_saveable: \['act'\] is an array of dtype float32 and shape \(2,\) in the "
        r"checkpoint, but the template has the string 'tanh' there",
    ):
        jd.checkpoint.from_saveable({"act": np.zeros(2, np.float32)}, {"act": "tanh"})
    with pytest.raises(
        ValueError,
        match=r"from_saveable: \['w'\] is an array of dtype <U4 in the checkpoint, but the "
        r"template's array is float32: <U4 is not a numeric dtype",
    ):
        jd.checkpoint.from_saveable({"w": np.array("relu")}, {"w": jnp.zeros(())})


# 6. Errors that teach ----------------------------------------------------------------------


def test_a_new_lambda_every_step_warns_once_and_a_kept_function_never() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    with pytest.warns(RuntimeWarning, match=r"was compiled 17 times.*strategy.function") as rec:
        for i in range(24):
            out = s.run(lambda ctx, x: x + 1.0, args=(float(i),))  # a new function each step
            assert float(s.reduce("sum", out)) == 2 * (i + 1)
    assert sum("compiled" in str(w.message) for w in rec) == 1

    def step(ctx: jd.ReplicaContext, x: jax.Array) -> jax.Array:
        return x * 2.0

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(24):
            assert float(s.reduce("sum", s.run(step, args=(float(i),)))) == 4 * i


def test_a_tf_style_function_that_binds_the_context_to_its_first_input_is_explained(
    mirrored8: jd.MirroredStrategy,
) -> None:
    def step(x, y):  # TF style; run passes (ctx, 1.0), so x is the context
        return x + y

    with pytest.raises(
        TypeError,
        match=r"a ReplicaContext was used as a value.*Declare the context first: "
        r"`def step\(ctx, x, y\): \.\.\.`",
    ):
        mirrored8.run(step, args=(1.0,))


def test_string_arrays_in_reduce_and_gather_name_the_leaf(mirrored8: jd.MirroredStrategy) -> None:
    names = {"ids": jd.PerReplica(jnp.zeros((8, 2))), "words": np.array(["a", "b"])}
    for method, call in (
        ("reduce", lambda: mirrored8.reduce("sum", names)),
        ("gather", lambda: mirrored8.gather(names, axis=0)),
    ):
        with pytest.raises(
            TypeError,
            match=rf"MirroredStrategy.{method}: value\['words'\] is an array of dtype <U1 "
            r"\(shape \(2,\)\); only numeric and bool arrays live on the devices of mesh "
            r"\{'replica': 8\}",
        ):
            call()


def test_string_arrays_in_batches_and_variables_name_the_leaf(
    mirrored8: jd.MirroredStrategy,
) -> None:
    batch = {"x": np.zeros((8, 2), np.float32), "words": np.array(["a"] * 8)}
    with pytest.raises(
        TypeError,
        match=r"experimental_distribute_dataset: leaf \['words'\] of a global batch is an array "
        r"of dtype <U1 \(shape \(8,\)\), which cannot be placed on the devices.*"
        r"experimental_fetch_to_device=False",
    ):
        list(mirrored8.experimental_distribute_dataset([batch]))
    with pytest.raises(
        TypeError,
        match=r"distribute_datasets_from_function: leaf \['words'\] of a per-replica batch",
    ):
        list(mirrored8.distribute_datasets_from_function(lambda ctx: [batch]))
    host = jd.InputOptions(experimental_fetch_to_device=False)  # host batches may hold text
    (got,) = list(mirrored8.experimental_distribute_dataset([batch], host))
    assert [w.tolist() for w in got["words"].values] == [["a"]] * 8
    with pytest.raises(
        TypeError, match=r"jaxdist.Variable\(name='w'\): initial_value is an array of dtype <U1"
    ):
        jd.Variable(np.array(["a"]), name="w")
    with pytest.raises(TypeError, match=r"dtype=<class 'str'> \(<U0\) is not a numeric dtype"):
        jd.Variable(1.0, dtype=str)
    with pytest.raises(
        TypeError,
        match=r"Variable.assign: cannot assign an array of dtype <U1 \(shape \(\)\) to variable "
        r"'v' of dtype float32",
    ):
        jd.Variable(0.0, name="v").assign(np.array("a"))


# 8. Nothing lost, nothing leaked --------------------------------------------------------


def _in_threads(count: int, target: Any) -> list[BaseException]:
    """Runs ``target(k)`` in ``count`` threads started together; returns their errors."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(k: int) -> None:
        try:
            barrier.wait()
            target(k)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), name=f"audit-{k}") for k in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


@pytest.mark.timeout(200)
def test_entry_points_are_safe_from_several_threads(mirrored8: jd.MirroredStrategy) -> None:
    s = mirrored8
    summed = s.function(lambda ctx, x: ctx.all_reduce("sum", x))
    with s.scope():
        start = jd.Variable(0.0, aggregation="sum")

    def scaled_mean(ctx: jd.ReplicaContext, x: jax.Array, k: float) -> jax.Array:
        return ctx.all_reduce("mean", x * k)

    def count(ctx: jd.ReplicaContext, v: jd.Variable) -> jd.Variable:
        return ctx.assign_add(v, 1.0)

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        x = rng.normal(size=(8, 3)).astype(np.float32)
        data = rng.normal(size=(40, 2)).astype(np.float32)
        per = jd.PerReplica(jnp.asarray(x))
        ds = s.experimental_distribute_dataset(jd.data.from_arrays(data, batch_size=16))
        v = start
        for _ in range(4):
            np.testing.assert_allclose(summed(per), x.sum(0), rtol=1e-5)
            np.testing.assert_allclose(
                s.run(scaled_mean, args=(per, float(k))), (x * k).mean(0), rtol=1e-5, atol=1e-6
            )
            np.testing.assert_array_equal(s.reduce("max", per), x.max(0))
            np.testing.assert_array_equal(s.gather(per, axis=0), x.reshape(-1))
            v = s.run(count, args=(v,))
            rows = [np.concatenate(s.experimental_local_results(b)) for b in ds]
            np.testing.assert_array_equal(np.concatenate(rows), data)
        assert float(v.read_value()) == 4 * 8

    assert _in_threads(4, work) == []


def _blocking_batches(release: threading.Event, rows: np.ndarray) -> Any:
    for i in range(0, len(rows), 16):
        yield rows[i : i + 16]
    release.wait(30)  # a source that hangs after its data (a socket that stays open)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["generator", "list"])
def test_one_iterator_shared_by_threads_serves_each_batch_once(
    mirrored8: jd.MirroredStrategy, source: str
) -> None:
    x = np.arange(16 * 20, dtype=np.float32)
    batches = [x[i : i + 16] for i in range(0, len(x), 16)]
    data = jd.data.from_generator(lambda: iter(batches)) if source == "generator" else batches
    ds = mirrored8.experimental_distribute_dataset(data)
    for _ in range(8):  # epochs: the end of each is where unserialized consumers hang
        it = iter(ds)
        got: list[list[np.ndarray]] = [[], [], [], []]

        def consume(k: int, it: Any = it, got: list = got) -> None:
            for b in it:
                got[k].append(np.concatenate(mirrored8.experimental_local_results(b)))

        assert _in_threads(4, consume) == []  # every consumer sees the end, none hangs
        rows = np.concatenate([r for g in got for r in g])
        np.testing.assert_array_equal(np.sort(rows), x)  # each row exactly once


@pytest.mark.timeout(60)
def test_closing_an_iterator_wakes_a_consumer_waiting_in_another_thread(
    mirrored8: jd.MirroredStrategy,
) -> None:
    release = threading.Event()
    x = np.arange(32, dtype=np.float32)
    ds = mirrored8.experimental_distribute_dataset(
        jd.data.from_generator(lambda: _blocking_batches(release, x))
    )
    it = iter(ds)
    assert len([next(it), next(it)]) == 2
    ended = threading.Event()

    def wait_for_more() -> None:
        with pytest.raises(StopIteration):
            next(it)  # the source hangs: this waits until close()
        ended.set()

    t = threading.Thread(target=wait_for_more)
    t.start()
    time.sleep(0.2)
    assert not ended.is_set()
    it.close()
    t.join(10)
    release.set()
    assert ended.is_set() and not t.is_alive()


def test_program_cache_evicts_the_least_recently_used() -> None:
    from jaxdist import _programs

    s = jd.MirroredStrategy(jax.devices()[:2])
    traces: dict[int, int] = {}

    def make(k: int) -> Any:
        def fn(ctx: jd.ReplicaContext, x: jax.Array) -> jax.Array:
            traces[k] = traces.get(k, 0) + 1
            return x + k

        return fn

    fns = [make(k) for k in range(4)]
    old = _programs.get_program_cache_size()
    try:
        jd.experimental.set_program_cache_size(3)
        for k in (0, 1, 2, 0, 3):  # 0 used again before 3 arrives: 1 is the oldest
            s.run(fns[k], args=(1.0,))
        assert traces == {0: 1, 1: 1, 2: 1, 3: 1}
        for k in (0, 2, 3):
            assert float(s.reduce("sum", s.run(fns[k], args=(1.0,)))) == 2 * (1 + k)
        assert traces == {0: 1, 1: 1, 2: 1, 3: 1}  # still cached
        s.run(fns[1], args=(1.0,))
        assert traces[1] == 2  # evicted, compiled again
        assert _programs.cached_program_count() <= 3
    finally:
        jd.experimental.set_program_cache_size(old)


_COLLECTED_WHILE_COMPILING = """
import gc
import jaxdist as jd

s = jd.OneDeviceStrategy()


def cyclic():
    def fn(ctx, x):
        return x + 1.0

    fn.self = fn  # a reference cycle: the function dies in a garbage collection
    return fn


for _ in range(3):
    f = cyclic()
    s.run(f, args=(1.0,))
    del f
gc.set_threshold(1)  # collect on the next allocations: while a new program is being built
print(float(s.run(lambda ctx, x: x * 2.0, args=(1.0,))))
"""


@pytest.mark.timeout(60)
def test_a_function_collected_while_a_program_is_built_does_not_deadlock() -> None:
    try:  # in a subprocess: a deadlock would hold the program cache's lock for good
        proc = subprocess.run(
            [sys.executable, "-c", _COLLECTED_WHILE_COMPILING],
            capture_output=True,
            text=True,
            timeout=30,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("run deadlocked: a finalizer took the program cache's lock it already held")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2.0"]


def test_extrema_propagate_nan_like_numpy(mirrored8: jd.MirroredStrategy) -> None:
    rows = np.arange(48, dtype=np.float32).reshape(8, 3, 2)
    rows[3, 1, 0] = np.nan
    per = jd.PerReplica(jnp.asarray(rows))
    for op in ("max", "min"):
        ref = getattr(np, op)
        inside = mirrored8.run(lambda ctx, x, op=op: ctx.all_reduce(op, x), args=(per,))
        np.testing.assert_array_equal(inside.array, ref(rows, axis=0))  # NaN == NaN here
        np.testing.assert_array_equal(mirrored8.reduce(op, per), ref(rows, axis=0))
        along = mirrored8.reduce(op, per, axis=0)
        np.testing.assert_array_equal(along, ref(rows.reshape(24, 2), axis=0))
        assert np.isnan(np.asarray(along)[0]) and not np.isnan(np.asarray(along)[1])


def test_every_thread_started_in_a_scope_is_warned_when_it_creates_a_variable(
    mirrored8: jd.MirroredStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxdist import context

    # Until the fix, warned thread idents are kept for good: keep this test's out of the
    # module, so later tests' threads (which may get the same idents) are still warned.
    monkeypatch.setattr(context, "_warned_threads", set(), raising=False)
    made: list[jd.Variable] = []

    def worker() -> None:
        with pytest.warns(RuntimeWarning, match=r"scope does not carry over to threads"):
            made.append(jd.Variable(1.0))

    with mirrored8.scope():
        for i in range(3):  # finished threads' idents are reused for new ones
            t = threading.Thread(target=worker, name=f"loader-{i}")
            t.start()
            t.join()
    assert len(made) == 3
    assert all(v.strategy.num_replicas_in_sync == 1 for v in made)  # the fallback, explained
