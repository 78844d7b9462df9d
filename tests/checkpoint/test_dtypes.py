"""Checkpoints of low-precision floating state: bfloat16 and float8 NaNs are refused like
float32 ones, and restoring across float8 formats says why it cannot."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

pytest.importorskip("orbax.checkpoint")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_nonfinite_low_precision_state_is_refused(tmp_path: Path, dtype: object) -> None:
    bad = {"w": jnp.array([1.0, np.nan, 2.0], dtype=dtype)}
    with pytest.raises(ValueError, match=r"\['w'\] \(1 of 3 values\)"):
        jd.checkpoint.save(tmp_path / "bad", bad)
    assert not (tmp_path / "bad").exists()
    good = {"w": jnp.array([1.0, 0.5, 2.0], dtype=dtype)}
    jd.checkpoint.save(tmp_path / "good", good)
    out = jd.checkpoint.restore(tmp_path / "good", {"w": jnp.zeros(3, dtype)})
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), [1.0, 0.5, 2.0])


def test_restoring_float8_into_another_float8_format_says_why(tmp_path: Path) -> None:
    jd.checkpoint.save(tmp_path / "ckpt", {"w": jnp.ones(3, jnp.float8_e4m3fn)})
    with pytest.raises(ValueError, match=r"float8_e4m3fn to float8_e5m2 loses precision"):
        jd.checkpoint.restore(tmp_path / "ckpt", {"w": jnp.zeros(3, jnp.float8_e5m2)})
