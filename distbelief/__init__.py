"""distbelief: DistBelief (Dean et al., 2012) for PyTorch — Downpour SGD and Sandblaster L-BFGS on Ray."""

from distbelief.api import TrainResult, release_workers, train, train_task
from distbelief.config import RunConfig
from distbelief.exceptions import ConfigError, DistBeliefError, RemoteTimeoutError, RoleFailedError
from distbelief.summary import Evaluation

__version__ = "0.1.0"
__all__ = ["train", "train_task", "TrainResult", "release_workers", "Evaluation", "RunConfig", "ConfigError", "DistBeliefError",
           "RemoteTimeoutError", "RoleFailedError"]
