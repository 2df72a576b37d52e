"""Layers whose units can be partitioned (docs/paper.md): each layer says which input units an output region needs
(its connectivity) and computes an output region from exactly those inputs with the parameters of that region.

Shapes. A layer's activation is ``(channels, *positions)`` with one or two position axes. A *region* (``Box``) is a
half-open range per position axis; it always spans every channel. Fully connected layers and the outputs have one
channel and one position per unit, so their units are partitioned like a 1-D layer.

Parameters. Every parameter tensor's leading axes are the layer's *output position* axes (``weight[l]`` belongs to
output position ``l``), so the parameters of the units in a region are ``tensor[box]`` — the slice a partition owns.
Locally connected layers are *untied* (a separate filter per output position), as in the paper's image model.

A layer computes ``forward(x, in_box, out_box, params)`` where ``x`` is ``(batch, C_in, *in_box sizes)`` covering
``in_box = needs(out_box)`` and ``params`` are the slices for ``out_box``; the result is
``(batch, C_out, *out_box sizes)``. Running a layer on the whole layer (one partition) and on a region give the
same numbers for that region — the partitioned model's oracle.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

Box = tuple[tuple[int, int], ...]
Shape = tuple[int, ...]  # (channels, *positions)


def box_size(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_volume(box: Box) -> int:
    return math.prod(box_size(box))


def box_empty(box: Box) -> bool:
    return any(hi <= lo for lo, hi in box)


def full_box(shape: Shape) -> Box:
    return tuple((0, n) for n in shape[1:])


def empty_box(ndim: int) -> Box:
    return tuple((0, 0) for _ in range(ndim))


def intersect(a: Box, b: Box) -> Box:
    return tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))


def clip(box: Box, shape: Shape) -> Box:
    return intersect(box, full_box(shape))


def crop(x: torch.Tensor, x_box: Box, want: Box) -> torch.Tensor:
    """The part of ``x`` (covering ``x_box``, shape ``(B, C, *sizes)``) that lies in ``want`` (inside ``x_box``)."""
    idx = (slice(None), slice(None)) + tuple(slice(w0 - x0, w1 - x0) for (x0, _), (w0, w1) in zip(x_box, want))
    return x[idx]


def param_slice(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The parameters of the output units in ``box`` (the leading axes of a parameter are output positions)."""
    return t[tuple(slice(lo, hi) for lo, hi in box)]


class Layer:
    """One layer of a partitioned model. Subclasses write only the computation and the connectivity.

    ``param_shapes`` gives, for each parameter, its full shape (leading axes = output positions); ``init_params``
    draws the full tensors from torch's global generator, so a model's initial values do not depend on how it
    is partitioned.
    """

    def out_shape(self, in_shape: Shape) -> Shape:
        return in_shape

    def needs(self, out_box: Box, in_shape: Shape) -> Box:
        """The input region that output region ``out_box`` reads (elementwise layers: the same region)."""
        return out_box

    def param_shapes(self, in_shape: Shape) -> dict[str, tuple[int, ...]]:
        return {}

    def init_params(self, in_shape: Shape) -> dict[str, torch.Tensor]:
        return {}

    def forward(self, x: torch.Tensor, in_box: Box, out_box: Box, params: dict[str, torch.Tensor],
                in_shape: Shape) -> torch.Tensor:
        raise NotImplementedError

    def flops_per_unit(self, in_shape: Shape) -> int:
        """Multiply-adds per output unit (for cost models and benchmarks)."""
        return 1


def _window_needs(out_box: Box, in_shape: Shape, kernel: Sequence[int], stride: Sequence[int]) -> Box:
    # Output position l reads inputs [l*s, l*s + k): a region [a, b) reads [a*s, (b-1)*s + k).
    if box_empty(out_box):
        return empty_box(len(out_box))
    return clip(tuple((a * s, (b - 1) * s + k) for (a, b), k, s in zip(out_box, kernel, stride)), in_shape)


def _window_out(in_shape: Shape, kernel: Sequence[int], stride: Sequence[int], channels: int) -> Shape:
    pos = tuple((n - k) // s + 1 for n, k, s in zip(in_shape[1:], kernel, stride))
    if any(p < 1 for p in pos):
        raise ValueError(f"window {tuple(kernel)} does not fit input positions {in_shape[1:]}")
    return (channels, *pos)


class FullyConnected(Layer):
    """``y = W x + b`` over all input units (flattened). Output: ``(1, out_features)``; every unit needs every
    input, which is why fully connected models partition badly."""

    def __init__(self, out_features: int, bias: bool = True):
        self.out_features, self.bias = out_features, bias

    def out_shape(self, in_shape: Shape) -> Shape:
        return (1, self.out_features)

    def needs(self, out_box: Box, in_shape: Shape) -> Box:
        return empty_box(len(in_shape) - 1) if box_empty(out_box) else full_box(in_shape)

    def param_shapes(self, in_shape: Shape) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": (self.out_features, math.prod(in_shape))}
        if self.bias:
            shapes["bias"] = (self.out_features,)
        return shapes

    def init_params(self, in_shape: Shape) -> dict[str, torch.Tensor]:
        d_in = math.prod(in_shape)
        bound = 1.0 / math.sqrt(d_in)  # nn.Linear's default range
        return {k: torch.empty(s).uniform_(-bound, bound) for k, s in self.param_shapes(in_shape).items()}

    def forward(self, x, in_box, out_box, params, in_shape):
        y = x.reshape(x.shape[0], -1) @ params["weight"].t()  # (B, F_region)
        if self.bias:
            y = y + params["bias"]
        return y.unsqueeze(1)

    def flops_per_unit(self, in_shape: Shape) -> int:
        return math.prod(in_shape)


class _LocallyConnected(Layer):
    """Untied filters: output position ``l`` has its own ``(C_out, C_in * prod(kernel))`` weights and bias."""

    ndim = 0

    def __init__(self, out_channels: int, kernel, stride=1, bias: bool = True):
        k = (kernel,) * self.ndim if isinstance(kernel, int) else tuple(kernel)
        s = (stride,) * self.ndim if isinstance(stride, int) else tuple(stride)
        if len(k) != self.ndim or len(s) != self.ndim or min(k) < 1 or min(s) < 1:
            raise ValueError(f"kernel and stride need {self.ndim} positive values, got {kernel!r}, {stride!r}")
        self.out_channels, self.kernel, self.stride, self.bias = out_channels, k, s, bias

    def out_shape(self, in_shape: Shape) -> Shape:
        if len(in_shape) != self.ndim + 1:
            raise ValueError(f"{type(self).__name__} needs inputs (C, {'L' if self.ndim == 1 else 'H, W'}), "
                             f"got {in_shape}")
        return _window_out(in_shape, self.kernel, self.stride, self.out_channels)

    def needs(self, out_box, in_shape):
        return _window_needs(out_box, in_shape, self.kernel, self.stride)

    def param_shapes(self, in_shape):
        pos = self.out_shape(in_shape)[1:]
        fan_in = in_shape[0] * math.prod(self.kernel)
        shapes = {"weight": (*pos, self.out_channels, fan_in)}
        if self.bias:
            shapes["bias"] = (*pos, self.out_channels)
        return shapes

    def init_params(self, in_shape):
        bound = 1.0 / math.sqrt(in_shape[0] * math.prod(self.kernel))
        return {k: torch.empty(s).uniform_(-bound, bound) for k, s in self.param_shapes(in_shape).items()}

    def flops_per_unit(self, in_shape):
        return in_shape[0] * math.prod(self.kernel)

    def _apply(self, patches: torch.Tensor, params, out_pos: tuple[int, ...]) -> torch.Tensor:
        # patches: (n_out, B, C_in*K); weight: (n_out, C_out, C_in*K) -> one batched matmul over positions.
        n = patches.shape[0]
        w = params["weight"].reshape(n, self.out_channels, -1)
        y = torch.bmm(patches, w.transpose(1, 2))  # (n_out, B, C_out)
        if self.bias:
            y = y + params["bias"].reshape(n, 1, self.out_channels)
        return y.permute(1, 2, 0).reshape(y.shape[1], self.out_channels, *out_pos)


class LocallyConnected1d(_LocallyConnected):
    """Locally connected 1-D layer (untied weights). Receptive field ``kernel``, step ``stride``, no padding."""

    ndim = 1

    def forward(self, x, in_box, out_box, params, in_shape):
        (k,), (s,) = self.kernel, self.stride
        n = box_size(out_box)[0]
        patches = x.unfold(2, k, s)[:, :, :n]  # (B, C_in, n, k)
        patches = patches.permute(2, 0, 1, 3).reshape(n, x.shape[0], -1)
        return self._apply(patches, params, (n,))


class LocallyConnected2d(_LocallyConnected):
    """Locally connected 2-D layer (untied weights), as in the paper's image model: each output position has its
    own filter bank over a ``kernel`` patch, ``stride`` apart, no padding."""

    ndim = 2

    def forward(self, x, in_box, out_box, params, in_shape):
        (kh, kw), (sh, sw) = self.kernel, self.stride
        nh, nw = box_size(out_box)
        patches = x.unfold(2, kh, sh).unfold(3, kw, sw)[:, :, :nh, :nw]  # (B, C_in, nh, nw, kh, kw)
        patches = patches.permute(2, 3, 0, 1, 4, 5).reshape(nh * nw, x.shape[0], -1)
        return self._apply(patches, params, (nh, nw))


class Pool(Layer):
    """Max or average pooling per channel over ``kernel`` windows, ``stride`` apart (default: = kernel)."""

    def __init__(self, kernel, stride=None, mode: str = "max"):
        if mode not in ("max", "avg"):
            raise ValueError(f"pooling mode must be 'max' or 'avg', got {mode!r}")
        self.kernel_arg, self.stride_arg, self.mode = kernel, stride, mode

    def _ks(self, ndim: int):
        k = (self.kernel_arg,) * ndim if isinstance(self.kernel_arg, int) else tuple(self.kernel_arg)
        s = k if self.stride_arg is None else (
            (self.stride_arg,) * ndim if isinstance(self.stride_arg, int) else tuple(self.stride_arg))
        return k, s

    def out_shape(self, in_shape):
        k, s = self._ks(len(in_shape) - 1)
        return _window_out(in_shape, k, s, in_shape[0])

    def needs(self, out_box, in_shape):
        k, s = self._ks(len(in_shape) - 1)
        return _window_needs(out_box, in_shape, k, s)

    def forward(self, x, in_box, out_box, params, in_shape):
        k, s = self._ks(len(in_shape) - 1)
        fn = {("max", 1): F.max_pool1d, ("avg", 1): F.avg_pool1d,
              ("max", 2): F.max_pool2d, ("avg", 2): F.avg_pool2d}[(self.mode, len(k))]
        return fn(x, k, s)

    def flops_per_unit(self, in_shape):
        return math.prod(self._ks(len(in_shape) - 1)[0])


def MaxPool(kernel, stride=None) -> Pool:  # noqa: N802 - reads like a layer class
    return Pool(kernel, stride, "max")


def AvgPool(kernel, stride=None) -> Pool:  # noqa: N802
    return Pool(kernel, stride, "avg")


def _local_mean(x: torch.Tensor, x_box: Box, want: Box, r: int, in_shape: Shape) -> torch.Tensor:
    """Mean of ``x`` over all channels and the ``(2r+1)^d`` window around each position of ``want``, counting
    only positions inside the layer (so every partition sees the same border behaviour). ``x`` covers
    ``x_box ⊇ clip(want ± r)``. Returns ``(B, 1, *want sizes)``."""
    src = clip(tuple((a - r, b + r) for a, b in want), in_shape)
    xs = crop(x, x_box, src).sum(1, keepdim=True)
    pad: list[int] = []
    for (w0, w1), (s0, s1) in reversed(list(zip(want, src))):  # F.pad lists the last axis first
        pad += [s0 - (w0 - r), (w1 + r) - s1]
    ones = torch.ones((1, 1, *box_size(src)), dtype=x.dtype)
    xs, ones = F.pad(xs, pad), F.pad(ones, pad)
    pool = F.avg_pool1d if len(want) == 1 else F.avg_pool2d
    return pool(xs, 2 * r + 1, 1) / (pool(ones, 2 * r + 1, 1) * x.shape[1])


class LocalContrastNorm(Layer):
    """Local contrast normalisation (subtractive then divisive, over all channels and a ``(2r+1)`` window):
    ``v = x - mean(x)``, ``y = v / sqrt(mean(v^2) + eps)``. It needs a halo of ``2r`` positions."""

    def __init__(self, radius: int = 2, eps: float = 1e-2):
        self.radius, self.eps = radius, eps

    def needs(self, out_box, in_shape):
        if box_empty(out_box):
            return out_box
        return clip(tuple((a - 2 * self.radius, b + 2 * self.radius) for a, b in out_box), in_shape)

    def forward(self, x, in_box, out_box, params, in_shape):
        r = self.radius
        mid = clip(tuple((a - r, b + r) for a, b in out_box), in_shape)  # where v is needed
        v = crop(x, in_box, mid) - _local_mean(x, in_box, mid, r, in_shape)
        var = _local_mean(v * v, mid, out_box, r, in_shape)
        return crop(v, mid, out_box) / torch.sqrt(var + self.eps)


class Activation(Layer):
    """Elementwise nonlinearity: ``relu``, ``sigmoid`` or ``tanh``."""

    FNS = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}

    def __init__(self, name: str = "relu"):
        if name not in self.FNS:
            raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(self.FNS)}")
        self.name = name

    def forward(self, x, in_box, out_box, params, in_shape):
        return self.FNS[self.name](x)


class Softmax(Layer):
    """Softmax output over all units of the layer, as log-probabilities (so ``F.cross_entropy`` on the model's
    output is exactly the softmax cross-entropy). Every unit needs every input (the normaliser)."""

    def needs(self, out_box, in_shape):
        return empty_box(len(out_box)) if box_empty(out_box) else full_box(in_shape)

    def forward(self, x, in_box, out_box, params, in_shape):
        logp = torch.log_softmax(x.reshape(x.shape[0], -1), dim=1).view(x.shape)
        return crop(logp, in_box, out_box)


class Logistic(Layer):
    """One-vs-all logistic outputs: an independent sigmoid per class (pair with :func:`one_vs_all_loss`)."""

    def forward(self, x, in_box, out_box, params, in_shape):
        return torch.sigmoid(x)


def one_vs_all_loss(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of each class's logistic output against ``target == class`` (mean over classes)."""
    onehot = F.one_hot(target, probs.shape[1]).to(probs.dtype)
    return F.binary_cross_entropy(probs.clamp(1e-7, 1 - 1e-7), onehot)
