"""Training on top of strategies: train steps, functional state, losses, the fit loop."""

from jaxdist.training.state import TrainState
from jaxdist.training.step import TrainStep, train_step

__all__ = ["TrainState", "TrainStep", "train_step"]
