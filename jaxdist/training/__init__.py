"""Training on top of strategies: train steps, functional state, losses, the fit loop."""

from jaxdist.training._guards import HostBatchWarning
from jaxdist.training.accumulate import accumulate_gradients
from jaxdist.training.callbacks import Callback, EarlyStopping, FitLoop, TerminateOnNaN
from jaxdist.training.checkpoints import Checkpoint, Restored, restore_checkpoint
from jaxdist.training.fit import FitInterrupted, FitPreempted, History, fit
from jaxdist.training.losses import compute_average_loss, scale_regularization_loss
from jaxdist.training.mixed_precision import DynamicLossScale, all_finite, select_tree
from jaxdist.training.state import TrainState
from jaxdist.training.step import TrainStep, train_step

__all__ = [
    "Callback",
    "Checkpoint",
    "DynamicLossScale",
    "EarlyStopping",
    "FitInterrupted",
    "FitPreempted",
    "FitLoop",
    "History",
    "HostBatchWarning",
    "Restored",
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
