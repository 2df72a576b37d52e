"""Warmstart from a checkpoint: every role's model starts from the same saved parameter vector.

The paper's Fig. 4 runs "all start from the same SGD warmstart". ``init_params`` names a ``params.safetensors``
file (or the run directory holding one) written by any earlier run; :class:`WarmStarted` wraps the user's
``model_fn`` so that every model built anywhere — the driver's evaluation model, which seeds the parameter shards,
and each worker's copy — holds those parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from distbelief.exceptions import ConfigError
from distbelief.ps.sharding import unflatten_into

PARAMS_FILE = "params.safetensors"
PARAMS_KEY = "flat_params"


def params_path(spec: str | Path) -> Path:
    """The safetensors file named by ``spec``: the file itself or a run directory containing one."""
    p = Path(spec)
    if p.is_dir():
        p = p / PARAMS_FILE
    if not p.is_file():
        raise ConfigError("init_params", f"no such file: {p} (give a params.safetensors file or the run "
                                         f"directory that holds one)")
    return p


def load_flat_params(spec: str | Path, num_parameters: int) -> torch.Tensor:
    """Read the flat parameter vector saved by a run; checks its size against the model's.

    Raises:
        ConfigError: missing or unreadable file, no ``flat_params`` tensor, or a size that is not the model's.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = params_path(spec)
    try:
        tensors = load_file(str(p))  # safetensors: no code is executed while loading
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError("init_params", f"{p} is not a readable safetensors file: {e}") from None
    if PARAMS_KEY not in tensors:
        raise ConfigError("init_params", f"{p} holds {sorted(tensors)} but no {PARAMS_KEY!r} tensor; use the "
                                         f"{PARAMS_FILE} of a distbelief run")
    flat = tensors[PARAMS_KEY].reshape(-1).to(torch.float32)
    if flat.numel() != num_parameters:
        raise ConfigError("init_params", f"{p} holds {flat.numel():,} parameters but the model has "
                                         f"{num_parameters:,}; warmstart from a run of the same model")
    if not torch.isfinite(flat).all():
        raise ConfigError("init_params", f"{p} contains NaN or Inf values")
    return flat


class WarmStarted:
    """``model_fn`` wrapper: build the model, then load ``flat`` into it (picklable; travels to workers)."""

    def __init__(self, model_fn: Callable[[], torch.nn.Module], flat: torch.Tensor):
        self.model_fn, self.flat = model_fn, flat

    def __call__(self) -> torch.nn.Module:
        model = self.model_fn()
        unflatten_into(model, self.flat)
        return model
