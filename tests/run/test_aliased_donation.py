"""An array passed twice to a compiled function that donates one of the two (``f(a, a)``
with ``donate_argnums=(0,)``) is refused before the program runs: XLA would overwrite a
buffer it also reads (on 8 CPU devices a segmentation fault, plain JAX too). Run in a fresh
process, so a regression fails one test instead of ending pytest."""

from __future__ import annotations

from _helpers import run_python

_CODE = r"""
import json
import jax.numpy as jnp
import numpy as np
import jaxdist as jd

strategy = jd.MirroredStrategy()
f = strategy.function(lambda ctx, a, b: a * 2 + b, donate_argnums=(0,))
out = {}
with strategy.scope():
    a = jnp.arange(4.0)
try:
    f(a, a)
except ValueError as e:
    out["error"] = str(e)
out["kept"] = not a.is_deleted()
b = jnp.arange(4.0) + 1
got = f(jnp.copy(a), b)
got = np.asarray(got.array if hasattr(got, "array") else got)
out["ok"] = bool(np.allclose(got, np.arange(4.0) * 2 + np.arange(4.0) + 1))
try:
    f(b, b)
except ValueError as e:
    out["again"] = str(e)
both = strategy.function(lambda ctx, a, b: a * 2 + b, donate_argnums=(0, 1))
try:
    both(b, b)  # both donated: the same buffer donated twice
except ValueError as e:
    out["twice"] = str(e)
out["b_kept"] = not b.is_deleted()
print(json.dumps(out))
"""


def test_an_array_donated_and_passed_again_is_refused() -> None:
    out = run_python(_CODE)
    assert "args[0] and args[1] are the same array" in out["error"], out
    assert "RunOptions(donate_argnums=(0,)) donates one of them" in out["error"]
    assert out["kept"] and out["ok"]  # nothing was donated; a copy runs and is right
    assert "are the same array" in out["again"]
    assert "args[0] and args[1] are the same array" in out["twice"], out
    assert "RunOptions(donate_argnums=(0, 1))" in out["twice"] and out["b_kept"]
