"""An iterator's saved position belongs to its data: restoring it into an iterator over
other data (another seed, other rows, no shuffling, another batch size) is refused, naming
both (issue 29, item 4); a restored iterator counts its position from the saved one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import jaxdist as jd

X = np.arange(64.0, dtype=np.float32).reshape(32, 2)


def _it(dataset: Any) -> Any:
    return iter(jd.MirroredStrategy().experimental_distribute_dataset(dataset))


def _rows(batches: Any) -> list[list[float]]:
    strategy = jd.MirroredStrategy()
    return [np.asarray(strategy.gather(b, axis=0)).tolist() for b in batches]


def _saved() -> dict[str, Any]:
    it = _it(jd.data.from_arrays(X, batch_size=8, shuffle=True, seed=0))
    next(it)
    return it.get_state()


@pytest.mark.parametrize(
    ("other", "names"),
    [
        (
            lambda: jd.data.from_arrays(X, batch_size=8, shuffle=True, seed=1),
            r"shuffled with seed 0.*this iterator reads from_arrays\(.*shuffled with seed 1",
        ),
        (
            lambda: jd.data.from_arrays(X[:16], batch_size=8, shuffle=True, seed=0),
            r"over from_arrays\(32 rows .*reads from_arrays\(16 rows",
        ),
        (
            lambda: jd.data.from_arrays(X, batch_size=8),
            r"shuffled with seed 0.*reads from_arrays\(.*not shuffled",
        ),
        (
            lambda: jd.data.from_arrays(X, batch_size=16, shuffle=True, seed=0),
            r"batch_size 8, .*reads from_arrays\(.*batch_size 16",
        ),
        (
            lambda: jd.data.from_arrays(X + 1.0, batch_size=8, shuffle=True, seed=0),
            r"rows' hash [0-9a-f]{16}\), but this iterator reads .*rows' hash [0-9a-f]{16}\)",
        ),
        (
            lambda: [X[i : i + 8] for i in range(0, 32, 8)],
            r"reads a list of 4 batches \(hash [0-9a-f]{16}\)",
        ),
    ],
)
def test_a_position_restored_into_other_data_is_refused_naming_both(
    other: Callable[[], Any], names: str
) -> None:
    # Before: accepted silently, and the iterator yielded other batches.
    it = _it(other())
    with pytest.raises(ValueError, match=r"set_state: the state was saved by an iterator over "):
        it.set_state(_saved())
    with pytest.raises(ValueError, match=names):
        _it(other()).set_state(_saved())


def test_the_same_data_rebuilt_resumes_and_a_second_resume_counts_from_the_first() -> None:
    def dataset() -> Any:
        return jd.data.from_arrays(X.copy(), batch_size=8, shuffle=True, seed=3)

    expected = _rows(_it(dataset()))  # 4 batches, uninterrupted
    first = _it(dataset())
    seen = _rows([next(first)])
    second = _it(dataset())
    second.set_state(first.get_state())
    seen += _rows([next(second) for _ in range(2)])
    # Before (a planted bug): the restored iterator reported its position from zero, so a
    # second resume in the same epoch replayed batches.
    assert second.get_state()["batches"] == 3
    third = _it(dataset())
    third.set_state(second.get_state())
    assert seen + _rows(third) == expected


def test_a_state_without_a_fingerprint_still_restores() -> None:
    # States saved before fingerprints existed (no "sources" key) are taken as they are.
    state = _saved()
    del state["sources"]
    it = _it(jd.data.from_arrays(X, batch_size=8, shuffle=True, seed=0))
    it.set_state(state)
    assert len(_rows(it)) == 3
