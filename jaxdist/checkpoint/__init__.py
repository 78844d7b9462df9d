"""Checkpoints of distributed training state: arrays with checksums, named items, a manager.

Three levels, each built on the one before:

- `save` / `restore` write and read one pytree of arrays, variables and
  distributed values with orbax-checkpoint, with a SHA-256 manifest that
  `restore` verifies; `to_saveable` / `from_saveable` are the host-array
  conversions under them (tf.distribute's variable rules: an ``ON_READ``
  variable saves its aggregate and restores under any replica count).
- `Checkpoint` (``tf.train.Checkpoint``) holds named items: pytrees (restored
  functionally), Flax NNX objects (restored in place) and data iterators
  (their position); it writes a whole directory atomically.
- `CheckpointManager` (``tf.train.CheckpointManager``) numbers checkpoints in
  one directory, keeps the newest ``max_to_keep``, and restores the latest;
  with ``enable_async_checkpointing=True`` a save stalls training only for the
  copy of the arrays to the host and is written in a background thread.

orbax-checkpoint is needed for the files (``pip install 'jaxdist[checkpoint]'``).
"""

from jaxdist.checkpoint._arrays import from_saveable, to_saveable
from jaxdist.checkpoint._checkpoint import Checkpoint
from jaxdist.checkpoint._manager import CheckpointManager
from jaxdist.checkpoint._status import LoadStatus
from jaxdist.checkpoint._storage import MANIFEST, restore, save

__all__ = [
    "MANIFEST",
    "Checkpoint",
    "CheckpointManager",
    "LoadStatus",
    "from_saveable",
    "restore",
    "save",
    "to_saveable",
]
