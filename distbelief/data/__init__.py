"""Data: the shipped tasks and per-replica minibatch sampling."""

from distbelief.data.batches import BatchSource, iterate_batches, replica_indices
from distbelief.data.tasks import TASKS, Task, TaskSpec, load_task, load_train

__all__ = ["BatchSource", "iterate_batches", "replica_indices", "TASKS", "Task", "TaskSpec", "load_task",
           "load_train"]
