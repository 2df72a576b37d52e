"""Where a replica computes: the ``device`` setting ("cpu", "cuda", "cuda:N" or "auto").

The parameter shards, the data plane, evaluation and checkpoints stay on the CPU in every case; a replica on a
GPU copies its fetched parameters to the device before each step and its gradient back after it
(``downpour.replica.WholeModel``). Which strategies take a GPU, and what is tested: docs/api.md, Devices.
"""

from __future__ import annotations

import re

import torch

from distbelief.exceptions import ConfigError

DEVICE_CHOICES = ("cpu", "cuda", "cuda:N", "auto")
# Strategies whose replicas compute on the device; the others (and partitioned replicas) run on the CPU.
DEVICE_STRATEGIES = ("sgd", "sync", "downpour")


def device_error(value) -> str | None:
    """Why ``value`` is not a device setting, or None when it is one."""
    if isinstance(value, str) and (value in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", value)):
        return None
    return f"unknown value {value!r}; choose one of: {', '.join(DEVICE_CHOICES)}"


def wants_gpu(value: str) -> bool:
    """Whether ``value`` asks for a GPU outright ("cuda", "cuda:N"; not "auto")."""
    return value.startswith("cuda")


def check_cuda_here(value: str, where: str) -> None:
    """ConfigError naming ``device`` when ``value`` asks for a CUDA device this process does not have (``where``:
    what computes in this process, for the message)."""
    if not wants_gpu(value):
        return
    if not torch.cuda.is_available():
        raise ConfigError("device", f"{value!r}: no CUDA device here ({where} computes in this process and "
                                    f"torch.cuda.is_available() is False); use device = \"cpu\" (or device = \"auto\")")
    index = torch.device(value).index
    if index is not None and index >= torch.cuda.device_count():
        raise ConfigError("device", f"{value!r}: this process has {torch.cuda.device_count()} CUDA device(s), "
                                    f"numbered from 0")


def resolve_device(value: str) -> torch.device:
    """The torch device for a device setting, in the process that computes: "auto" is "cuda" when this process
    has a CUDA device, else "cpu"."""
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(value)
