"""The fit loop: `fit` runs train steps over epochs with callbacks, progress, checkpoints,
resuming and preemption. Internal: the public names are exported from
`jaxdist.training`.
"""
