"""The programs behind `strategy.run`: a function compiled anew every step is warned about
once, the cache is bounded and evicts the least recently used, programs die with their
functions, and a function collected while a program is built does not deadlock.

Results are small floats compared exactly; trace counts are counted in the functions."""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import warnings
from typing import Any

import jax
import pytest

import jaxdist as jd
from jaxdist._run import programs


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


def test_program_cache_evicts_the_least_recently_used() -> None:
    from jaxdist._run import programs

    s = jd.MirroredStrategy(jax.devices()[:2])
    traces: dict[int, int] = {}

    def make(k: int) -> Any:
        def fn(ctx: jd.ReplicaContext, x: jax.Array) -> jax.Array:
            traces[k] = traces.get(k, 0) + 1
            return x + k

        return fn

    fns = [make(k) for k in range(4)]
    old = programs.get_program_cache_size()
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
        assert programs.cached_program_count() <= 3
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


def test_recompiling_a_new_lambda_every_step_warns_once() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    with pytest.warns(RuntimeWarning, match=r"compiled 17 times.*strategy.function") as record:
        for i in range(20):
            s.run(functools.partial(lambda ctx, x, k: x + k, k=i), args=(1.0,))
    assert len([w for w in record if "compiled" in str(w.message)]) == 1


def test_programs_die_with_their_functions() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    gc.collect()
    before = programs.cached_program_count()
    for _ in range(5):
        s.run(eval("lambda ctx, x: x + 1"), args=(1.0,))  # a new code object each time
    gc.collect()
    assert programs.cached_program_count() == before


def test_program_cache_is_bounded() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    old = programs.get_program_cache_size()
    kept = [eval(f"lambda ctx, x: x + {i}") for i in range(6)]
    try:
        programs.set_program_cache_size(3)
        for fn in kept:
            s.run(fn, args=(1.0,))
        assert programs.cached_program_count() <= 3
        assert float(s.run(kept[0], args=(1.0,))) == 1.0  # evicted: compiled again
    finally:
        programs.set_program_cache_size(old)
    with pytest.raises(ValueError, match=r"size must be an int >= 1"):
        programs.set_program_cache_size(0)
