"""A model as the simulator sees it: parameters and multiply-adds per example, by layer kind.

``profile_model`` reads a shipped model (built for real, on the CPU, so the counts are the model's own);
``profile_layers`` reads a stack of partition layers (``distbelief.partition``) without building any parameter,
which is how the paper's 1.7 B-parameter model is described (simulate/paper.py).

Layer kinds, each with its own measured rate (``Costs.macs_per_s``): ``dense`` (fully connected: one GEMM),
``local`` (locally connected, untied: many small GEMMs, a slower rate), ``other`` (convolutions, pooling,
normalisation) and ``elementwise`` (one operation per unit: activations, and the loss's softmax and
cross-entropy over the outputs, which for 8,192 classes cost as much as a hidden layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distbelief.exceptions import ConfigError

# Input shape of each shipped task (without the batch axis), as the data generators make them.
TASK_INPUT = {"mnist1d": (40,), "speech": (11, 40), "shapes": (1, 32, 32)}


@dataclass(frozen=True)
class ModelProfile:
    name: str
    params: int
    macs: dict[str, float]  # forward multiply-adds per example, by layer kind
    # weight-matrix shapes (rows, cols) in flat order: PowerSGD compresses these and sends the rest whole
    matrices: tuple[tuple[int, int], ...] = ()
    # activations per example at each layer boundary (model parallelism's messages), input first
    widths: tuple[int, ...] = ()
    layers: tuple = field(default=(), compare=False)  # partition layers, when built from them
    input_shape: tuple[int, ...] = ()
    # every parameter tensor as (flat offset, shape), in flat order (PowerSGD's layout)
    tensors: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def macs_per_example(self) -> float:
        return sum(self.macs.values())


def profile_model(model: str, task: str = "speech", num_classes: int | None = None) -> ModelProfile:
    """The profile of shipped model ``model`` on ``task`` (its input shape; ``num_classes`` as the run would
    have it, None: the task's default for the model)."""
    import torch

    from distbelief.defaults import default_num_classes
    from distbelief.models import build_model

    if task not in TASK_INPUT:
        raise ConfigError("task", f"the simulator knows the shapes of {', '.join(TASK_INPUT)}; got {task!r}")
    shape = TASK_INPUT[task]
    classes = num_classes or default_num_classes(task, model) or {"mnist1d": 10, "shapes": 8}.get(task, 10)
    with torch.device("meta"):
        m = build_model(model, shape, classes)
    layers = getattr(m, "layers", None)
    if layers is not None:  # a PartitionedModel: count from its layers
        p = profile_layers(model, tuple(m.input_shape), list(layers))
        return ModelProfile(model, sum(t.numel() for t in m.parameters()), p.macs, p.matrices, p.widths,
                            p.layers, p.input_shape, _tensors(m))
    macs = {"dense": 0.0, "local": 0.0, "other": 0.0, "elementwise": 0.0}
    matrices, widths = [], [math.prod(shape)]
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear):
            macs["dense"] += mod.in_features * mod.out_features
            matrices.append((mod.out_features, mod.in_features))
            widths.append(mod.out_features)
        elif isinstance(mod, (torch.nn.ReLU, torch.nn.Sigmoid, torch.nn.Tanh)):
            macs["elementwise"] += widths[-1]
        elif isinstance(mod, torch.nn.Conv1d):
            # MNIST1DConvNet: the output length is the input's (padding keeps it) over the stride
            length = math.ceil(shape[-1] / mod.stride[0])
            macs["other"] += length * mod.out_channels * mod.in_channels * mod.kernel_size[0] // mod.groups
            matrices.append((mod.out_channels, mod.in_channels * mod.kernel_size[0]))
    macs["elementwise"] += classes  # the loss: softmax and cross-entropy over the outputs
    return ModelProfile(model, sum(t.numel() for t in m.parameters()), macs, tuple(matrices), tuple(widths),
                        (), shape, _tensors(m))


def _tensors(m) -> tuple[tuple[int, tuple[int, ...]], ...]:
    out, off = [], 0
    for t in m.parameters():
        out.append((off, tuple(t.shape)))
        off += t.numel()
    return tuple(out)


def profile_layers(name: str, input_shape: tuple[int, ...], layers: list) -> ModelProfile:
    """The profile of a stack of partition layers (``distbelief.partition.layers``): parameters from their
    shapes and multiply-adds from ``flops_per_unit`` times the output units, nothing allocated."""
    macs = {"dense": 0.0, "local": 0.0, "other": 0.0, "elementwise": 0.0}
    params, matrices, tensors = 0, [], []
    shape = tuple(input_shape)
    widths = [math.prod(shape)]
    for layer in layers:
        out = tuple(layer.out_shape(shape))
        units = math.prod(out)
        macs[layer_kind(layer)] += layer.flops_per_unit(shape) * units
        for pname, pshape in layer.param_shapes(shape).items():
            n = math.prod(pshape)
            tensors.append((params, tuple(pshape)))
            params += n
            if pname == "weight" and len(pshape) >= 2:
                matrices.append((pshape[0], n // pshape[0]))
        shape = out
        widths.append(units)
    macs["elementwise"] += widths[-1]  # the loss over the outputs
    return ModelProfile(name, params, macs, tuple(matrices), tuple(widths), tuple(layers), tuple(input_shape),
                        tuple(tensors))


def layer_kind(layer) -> str:
    """The ``Costs.macs_per_s`` kind of a partition layer (``distbelief.partition.layers``)."""
    from distbelief.partition.layers import Activation, FullyConnected

    if isinstance(layer, FullyConnected):
        return "dense"
    if isinstance(layer, Activation):
        return "elementwise"
    return "local" if type(layer).__name__.startswith("LocallyConnected") else "other"
