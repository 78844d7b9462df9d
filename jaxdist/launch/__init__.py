"""`python -m jaxdist.launch` / ``jaxdist-launch``: start a multi-process job on this machine.

The launcher needs only the standard library, so it starts without importing JAX.
`jaxdist.launch.cli` parses the command line and supervises the processes,
`config` turns the command line into a `LaunchConfig` and each process's
environment, `processes` signals and waits on the processes, and `output` copies
their output, line by line and prefixed, to the launcher's.
"""

from __future__ import annotations

from jaxdist.launch.cli import main
from jaxdist.launch.config import LaunchConfig

__all__ = ["LaunchConfig", "main"]
