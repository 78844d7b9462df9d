"""Training on top of strategies: train steps, functional state, losses, the fit loop.

The train step (`train_step`, `TrainStep`, `TrainState`, losses, gradient
accumulation, loss scaling) lives in `jaxdist.training.step`; the loop (`fit`, its
callbacks, checkpoints and resuming) in `jaxdist.training.fit`, which builds on the
step. `ModelCheckpoint` is Keras's name for the `Checkpoint` callback.
"""

from jaxdist.training.fit.callbacks import Callback, EarlyStopping, FitLoop, TerminateOnNaN
from jaxdist.training.fit.checkpoints import Checkpoint, Restored, restore_checkpoint
from jaxdist.training.fit.fit import FitInterrupted, FitPreempted, History, fit
from jaxdist.training.fit.metrics_logger import MetricsLogger
from jaxdist.training.fit.profile import Profile
from jaxdist.training.step.accumulate import accumulate_gradients
from jaxdist.training.step.guards import HostBatchWarning
from jaxdist.training.step.losses import compute_average_loss, scale_regularization_loss
from jaxdist.training.step.mixed_precision import DynamicLossScale, all_finite, select_tree
from jaxdist.training.step.state import TrainState
from jaxdist.training.step.train_step import StepOptions, TrainStep, train_step

ModelCheckpoint = Checkpoint  # Keras's name for the fit callback that saves checkpoints

__all__ = [
    "Callback",
    "Checkpoint",
    "DynamicLossScale",
    "EarlyStopping",
    "FitInterrupted",
    "FitPreempted",
    "FitLoop",
    "History",
    "ModelCheckpoint",
    "HostBatchWarning",
    "MetricsLogger",
    "Profile",
    "Restored",
    "StepOptions",
    "TerminateOnNaN",
    "TrainState",
    "TrainStep",
    "accumulate_gradients",
    "all_finite",
    "compute_average_loss",
    "fit",
    "restore_checkpoint",
    "scale_regularization_loss",
    "select_tree",
    "train_step",
]
