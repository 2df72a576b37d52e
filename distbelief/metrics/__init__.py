"""What a run records and how it is timed, one module per job:

- :mod:`.clock`: the training clock (``Clock``), pausable, continued by a resumed run.
- :mod:`.schedule`: when to evaluate next (``EvalSchedule``).
- :mod:`.recorder`: the run directory and live progress (``RunRecorder``).
- :mod:`.rundir`: where a run directory goes and reading its records back (``default_run_dir``, ``read_metrics``).
- :mod:`.tensorboard`: a record's TensorBoard scalars (``tensorboard_scalars``).
- :mod:`.divergence`: stopping a run whose loss exploded (``DivergenceWatch``, ``divergence_message``).
- :mod:`.plots`: accuracy and loss vs time of one or more runs (``plot_runs``).
"""

from distbelief.metrics.clock import Clock
from distbelief.metrics.divergence import DIVERGENCE_CEILING, DivergenceWatch, divergence_message
from distbelief.metrics.plots import plot_runs
from distbelief.metrics.recorder import RunRecorder
from distbelief.metrics.rundir import default_run_dir, read_metrics
from distbelief.metrics.schedule import EvalSchedule
from distbelief.metrics.tensorboard import TENSORBOARD_DIR, tensorboard_scalars

__all__ = ["Clock", "DIVERGENCE_CEILING", "DivergenceWatch", "EvalSchedule", "RunRecorder", "TENSORBOARD_DIR",
           "default_run_dir", "divergence_message", "plot_runs", "read_metrics", "tensorboard_scalars"]
