"""The parameter-server task: a Ray actor holding variables as NumPy arrays.

Each method call runs alone (a Ray actor runs one call at a time), so the deltas of
one closure are applied atomically, and reads see whole updates.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["ParameterServer"]


class ParameterServer:
    """One ``ps`` task: variable id -> value."""

    def __init__(self, task_index: int) -> None:
        self._task_index = task_index
        self._values: dict[int, np.ndarray] = {}

    def ping(self) -> int:
        return os.getpid()

    def create(self, var_id: int, value: np.ndarray) -> None:
        self._values[var_id] = np.array(value, copy=True)

    def read(self, ids: list[int]) -> list[np.ndarray]:
        return [self._values[i] for i in ids]

    def apply(self, updates: dict[int, tuple[str, Any]]) -> None:
        """Applies ``{id: ("add", delta) | ("set", value)}``, all in this one call."""
        for var_id, (kind, x) in updates.items():
            current = self._values[var_id]
            if kind == "add":
                np.add(current, x, out=current, casting="unsafe")
            else:
                self._values[var_id] = np.array(x, dtype=current.dtype, copy=True)
