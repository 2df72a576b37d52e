"""Data: the shipped tasks and per-replica minibatch sampling (or streaming)."""

from distbelief.data.batches import BatchSource, StreamBatches, iterate_batches, replica_indices
from distbelief.data.tasks import TASKS, Task, TaskSpec, load_task, load_train

__all__ = ["BatchSource", "StreamBatches", "iterate_batches", "replica_indices", "TASKS", "Task", "TaskSpec",
           "load_task", "load_train"]
