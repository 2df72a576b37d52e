"""Module buffers (BatchNorm's running mean and variance, its batch counter): state that is not trained by
gradients, so the parameter shards do not hold it.

Each replica updates its own buffers as it computes (in training mode). The driver reads them from the live
replicas at every evaluation and averages them — floating-point buffers by their mean, integer ones (counters)
by their maximum — and evaluates with the result; the final model and ``params.safetensors`` carry the last
average. Between replicas that see the same data distribution the running statistics agree up to noise, so the
average is the estimate a single process would have, with less variance.
"""

from __future__ import annotations

import torch

BUFFER_PREFIX = "buffer."  # the key prefix of a buffer in params.safetensors (the parameters are "flat_params")


def buffers_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the model's persistent buffers (those in its ``state_dict``), by name."""
    persistent = set(model.state_dict())
    return {name: b.detach().clone() for name, b in model.named_buffers() if name in persistent}


def average(replica_buffers: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The replicas' buffers combined: floating point by their mean, integers by their maximum."""
    replica_buffers = [b for b in replica_buffers if b]
    if not replica_buffers:
        return {}
    out = {}
    for name in replica_buffers[0]:
        values = [torch.as_tensor(b[name]) for b in replica_buffers if name in b]
        stacked = torch.stack(values)
        out[name] = stacked.mean(0) if stacked.is_floating_point() else stacked.max(0).values
    return out


def load_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy ``buffers`` into the model's buffers of the same names (in place; names it lacks are an error)."""
    own = dict(model.named_buffers())
    missing = set(buffers) - set(own)
    if missing:
        raise KeyError(f"the model has no buffers named {sorted(missing)}")
    with torch.no_grad():
        for name, value in buffers.items():
            own[name].copy_(torch.as_tensor(value).to(own[name].dtype))
