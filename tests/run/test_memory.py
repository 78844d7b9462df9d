"""Distinct replica functions do not pile up: memory stays within 2x of plain `jax.jit`.

Each side runs in a fresh interpreter: 1,000 distinct closures, each capturing
a 256 KiB array, are compiled and called once; the RSS growth of jaxdist's
`strategy.run` must stay within 2x of `jax.jit` doing the same (plus 64 MiB of
slack for allocator noise).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import gc, os, sys
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)  # the recompile warning, expected here
    import jax, jax.numpy as jnp, numpy as np, psutil
    import jaxdist as jd
    mode = sys.argv[1]
    s = jd.OneDeviceStrategy()
    x = jnp.ones(4)

    def make(i):
        big = jnp.asarray(np.full(65536, i, np.float32))  # 256 KiB captured by the closure
        if mode == "jit":
            return jax.jit(lambda x: x + big[0])
        return lambda ctx, x: x + big[0]

    def call(f):
        if mode == "jit":
            return f(x)
        return s.run(f, args=(x,))

    for i in range(20):  # warm up allocators and caches
        call(make(i)).block_until_ready()
    gc.collect()
    before = psutil.Process().memory_info().rss
    for i in range(1000):
        call(make(i)).block_until_ready()
    gc.collect()
    print((psutil.Process().memory_info().rss - before) / 2**20)
    """
)


def _start(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )


def _growth_mib(proc: subprocess.Popen[str]) -> float:
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err
    return float(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_thousand_distinct_functions_keep_memory_like_jit() -> None:
    jit_proc, ours_proc = _start("jit"), _start("jaxdist")  # both at once: 2 cores
    jit, ours = _growth_mib(jit_proc), _growth_mib(ours_proc)
    assert ours <= 2 * max(jit, 0.0) + 64, (ours, jit)
