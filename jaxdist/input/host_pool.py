"""Host buffers for the batches a prefetch thread copies out of its source.

A Python generator may refill one buffer for every batch it yields, and the
prefetch thread resumes the source while earlier batches are still queued or
being transferred (``jax.device_put`` reads a NumPy array asynchronously), so
the thread copies every batch that views the source's memory. A `HostPool`
makes that copy cheap:

- its buffers are reused, so a copy costs no page faults and no zeroing of a
  fresh allocation (which doubled the copy's price);
- its buffers are aligned for the CPU backend, which then uses them as the
  device buffers instead of copying them again: on CPU the pool's copy is the
  only copy a batch makes, as in a hand-written ``device_put`` loop.

A buffer is reused only when nothing but the pool refers to it: not a queued
batch, not a view of it, not a user holding host batches, and not JAX, which
keeps a reference to an array it reads until its transfer is done, or for as
long as a device buffer uses its memory. The reference count is the one
signal that covers them all.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np

from jaxdist.input.batching import HostBatch

# XLA's CPU runtime wraps host memory aligned to this many bytes without copying it.
ALIGNMENT = 64


def _refs(buffers: list[np.ndarray], i: int) -> tuple[int, int]:
    """The references to a pool buffer and to the memory it views (a view of the buffer
    refers to that memory's owner, not to the buffer)."""
    return sys.getrefcount(buffers[i]), sys.getrefcount(buffers[i].base)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts at an `ALIGNMENT` boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


# What `_refs` sees for a buffer that only its pool's list holds (measured through the
# same function, so it does not depend on how the interpreter counts references).
_IDLE = _refs([aligned_empty((1,), np.uint8)], 0)


class HostPool:
    """Copies arrays into aligned buffers it owns, reusing a buffer once nothing else
    holds it.

    ``per_shape`` bounds the buffers kept for one shape and dtype (the batches in
    flight: queued, being placed, on the devices); past it a copy gets a fresh
    buffer that is not kept. Used by one thread (others only drop references).
    """

    def __init__(self, per_shape: int) -> None:
        self.per_shape = per_shape
        self._buffers: dict[tuple[tuple[int, ...], Any], list[np.ndarray]] = {}

    def copy(self, a: np.ndarray) -> np.ndarray:
        """A copy of ``a`` in a buffer that no one else refers to."""
        buffers = self._buffers.setdefault((a.shape, a.dtype), [])
        for i in range(len(buffers)):
            if _refs(buffers, i) == _IDLE:
                out = buffers[i]
                break
        else:
            out = aligned_empty(a.shape, a.dtype)
            if len(buffers) < self.per_shape:
                buffers.append(out)
        if a.flags.c_contiguous:  # memmove releases the GIL for the consumer; copyto does not
            ctypes.memmove(out.ctypes.data, a.ctypes.data, a.nbytes)
        else:
            np.copyto(out, a)
        return out

    def owned(self, host: HostBatch) -> HostBatch:
        """``host`` with every leaf that views another array's memory copied."""
        leaves, counts = host
        return [a if a.flags.owndata else self.copy(a) for a in leaves], counts
