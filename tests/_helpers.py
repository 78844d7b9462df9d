"""Small helpers shared by the tests (not a test module)."""

from __future__ import annotations

from typing import Any

import numpy as np

import jaxdist as jd


def value(x: Any) -> np.ndarray:
    """The global array behind a run output: ``x.array`` for distributed values; a plain
    output (what run returns with one replica) as it is."""
    return np.asarray(x.array if isinstance(x, jd.DistributedValues) else x)


def assert_kind(x: Any, kind: type, strategy: jd.Strategy) -> None:
    """``x`` is a ``kind`` (`Mirrored`/`PerReplica`), or a plain array with one replica."""
    if strategy.num_replicas_in_sync == 1:
        assert not isinstance(x, jd.DistributedValues), type(x)
    else:
        assert isinstance(x, kind), type(x)


def rows(x: Any, strategy: jd.Strategy) -> np.ndarray:
    """A per-replica output as ``(N, ...)`` rows (a plain one-replica output gets a row axis)."""
    v = value(x)
    return v if isinstance(x, jd.DistributedValues) else v[None]
