"""Named models for the shipped tasks. Any ``nn.Module`` factory works with distbelief; these are conveniences."""

from __future__ import annotations

import math

from torch import nn

# name -> (hidden widths, activation). Speech models follow the paper: sigmoid units, softmax output.
_MLPS = {
    "mlp": ((256, 256), nn.ReLU),
    "mlp-small": ((64,), nn.ReLU),
    "speech-tiny": ((256, 256), nn.Sigmoid),
    "speech-small": ((1024, 1024), nn.Sigmoid),
    "speech-medium": ((2048, 2048, 2048), nn.Sigmoid),
    "speech-paper": ((2560, 2560, 2560, 2560), nn.Sigmoid),  # 440-2560x4-8192: ~42M parameters
}
MODELS = tuple(_MLPS) + ("cnn",)


class MNIST1DConvNet(nn.Module):
    """A small 1-D CNN for MNIST-1D (input: 40 samples)."""

    def __init__(self, input_len: int, num_classes: int, channels: int = 25):
        super().__init__()
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, input_len)),
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(),
        )
        out_len = input_len
        for k, s, p in ((5, 2, 1), (3, 2, 1), (3, 2, 1)):
            out_len = (out_len + 2 * p - k) // s + 1
        self.head = nn.Linear(channels * out_len, num_classes)

    def forward(self, x):
        return self.head(self.net(x))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a named model for inputs of ``input_shape`` (without batch) and ``num_classes`` outputs."""
    d_in = math.prod(input_shape)
    if name == "cnn":
        return MNIST1DConvNet(d_in, num_classes)
    if name not in _MLPS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    widths, act = _MLPS[name]
    layers: list[nn.Module] = [nn.Flatten()] if len(input_shape) > 1 else []
    prev = d_in
    for w in widths:
        layers += [nn.Linear(prev, w), act()]
        prev = w
    layers.append(nn.Linear(prev, num_classes))
    return nn.Sequential(*layers)
