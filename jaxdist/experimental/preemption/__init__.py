"""Preemption: `PreemptionCheckpointHandler` (`handler`), the agreement of every process on
the step to save at (`agreement`), and `TerminationConfig` (`termination`). Internal: the
public names are exported from `jaxdist.experimental`.
"""
