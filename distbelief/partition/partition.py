"""Partition: one partition's share of a training step, with explicit boundary messages.

Forward, layer by layer: send the other partitions the boxes of my previous-layer output that they need (each
unit once per destination, from the ExchangePlan), receive the boxes I need, assemble my input box, compute my
output region with my own parameters. The head partition gathers the model's output, computes the loss and sends
every partition the gradient of its output region. Backward, layer by layer in reverse: autograd gives the
gradients of my parameters (accumulated into their ``.grad``) and of my input box; I return each received box's
gradient to its owner along the same edge, and sum what the others return for my units into my own gradient.

No engine here: messages go through a :class:`~distbelief.runtime.transport.Transport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from distbelief.partition.layers import Box, box_empty, box_size, crop, full_box, intersect
from distbelief.partition.model import PartitionedModel
from distbelief.partition.plan import HEAD
from distbelief.runtime.transport import Transport


@dataclass
class MessageStats:
    """Messages and bytes a partition sent, by phase (``forward``, ``backward``, ``output``), cumulative."""

    messages: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0, "output": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0, "output": 0})

    def add(self, phase: str, t: torch.Tensor) -> None:
        self.messages[phase] += 1
        self.bytes[phase] += t.numel() * t.element_size()

    @property
    def bytes_sent(self) -> int:
        return sum(self.bytes.values())

    @property
    def messages_sent(self) -> int:
        return sum(self.messages.values())

    def as_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "messages_sent": self.messages_sent,
                "bytes_by_phase": dict(self.bytes), "messages_by_phase": dict(self.messages)}


def _place(dst: torch.Tensor, dst_box: Box, src_box: Box, value: torch.Tensor) -> None:
    """``dst[src_box] = value`` where ``dst`` covers ``dst_box`` (differentiable slice assignment)."""
    idx = (slice(None), slice(None)) + tuple(slice(s0 - d0, s1 - d0) for (d0, _), (s0, s1) in zip(dst_box, src_box))
    dst[idx] = value


class Partition:
    """One partition of a model replica: the units it owns in every layer and their parameters.

    Args:
        model: the PartitionedModel (only this partition's parameter slices are read or written).
        partition_id: which partition this is; partition 0 is the head (it holds labels and computes the loss).
        transport: connects this partition to the replica's other partitions.
        timeout_s: how long any receive may wait.

    Thread-safety: one step at a time; partitions of a replica must run their steps concurrently (each blocks on
    the others' messages).
    """

    def __init__(self, model: PartitionedModel, partition_id: int, transport: Transport, timeout_s: float = 120.0):
        self.model, self.partition_id, self.transport, self.timeout_s = model, partition_id, transport, timeout_s
        self.plan = model.plan
        self.params = [model.layer_params(partition_id, i) for i in range(len(model.layers))]
        self.stats = MessageStats()
        self.steps = 0

    def _send(self, phase: str, dst: int, key, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        self.stats.add(phase, t)
        self.transport.send(dst, key, t)

    def _recv(self, src: int, key) -> torch.Tensor:
        return self.transport.recv(src, key, self.timeout_s)

    def step(self, x: torch.Tensor, y: torch.Tensor | None = None,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             backward: bool = True) -> tuple[float | None, torch.Tensor | None]:
        """Run this partition's part of one forward (and backward) pass over the minibatch ``x``.

        Every partition gets the same ``x`` but reads only the input units its first layer needs. The head
        also needs ``y`` and ``loss_fn`` when ``backward``. Parameter gradients are *added* to the ``.grad`` of
        this partition's parameters. Returns ``(loss, output)`` on the head, ``(None, None)`` elsewhere.
        """
        plan, p, sid = self.plan, self.partition_id, self.steps
        self.steps += 1
        B = x.shape[0]
        saved = []  # per layer: (own input leaf, its box, received leaves, output region)
        h = x.reshape(B, *plan.shapes[0])
        h_box = full_box(plan.shapes[0])
        for i, layer in enumerate(self.model.layers):
            in_shape, need, out_box = plan.shapes[i], plan.needs[i][p], plan.regions[i][p]
            own_leaf, own_part, leaves = None, need, []
            if i == 0:
                xin = crop(h, h_box, need)  # input data: each partition reads its own needs, nothing is sent
            else:
                for t in plan.sends[i][p]:
                    self._send("forward", t.dst, (sid, "f", i), crop(h, h_box, t.box))
                pieces = []
                own_part = intersect(need, h_box)
                if not box_empty(own_part):
                    own_leaf = crop(h, h_box, own_part).detach().requires_grad_(backward)
                    pieces.append((own_part, own_leaf))
                for t in plan.recvs[i][p]:
                    leaf = self._recv(t.src, (sid, "f", i)).requires_grad_(backward)
                    leaves.append(leaf)
                    pieces.append((t.box, leaf))
                if len(pieces) == 1 and pieces[0][0] == need:
                    xin = pieces[0][1]
                else:
                    xin = torch.zeros(B, in_shape[0], *box_size(need))
                    for box, piece in pieces:
                        _place(xin, need, box, piece)
            if box_empty(out_box):
                out = torch.zeros(B, plan.shapes[i + 1][0], *box_size(out_box))
            else:
                with torch.set_grad_enabled(backward):
                    out = layer.forward(xin, need, out_box, self.params[i], in_shape)
            saved.append((own_leaf, own_part, leaves, out))
            h, h_box = out, out_box

        # The head gathers the output (one message per other partition) and computes the loss.
        out_shape = plan.shapes[-1]
        loss, output, g = None, None, None
        if p != HEAD:
            if not box_empty(h_box):
                self._send("output", HEAD, (sid, "o"), h)
            if backward and not box_empty(h_box):
                g = self._recv(HEAD, (sid, "og"))
        else:
            full = torch.zeros(B, *out_shape)
            for q in range(plan.num_partitions):
                box = plan.regions[-1][q]
                if not box_empty(box):
                    _place(full, full_box(out_shape), box, h.detach() if q == p else self._recv(q, (sid, "o")))
            output = full.reshape(B, -1)
            if backward:
                if y is None or loss_fn is None:
                    raise ValueError("the head partition needs labels and a loss function for a backward pass")
                leaf = output.detach().requires_grad_(True)
                value = loss_fn(leaf, y)
                value.backward()
                loss = float(value.detach())
                g_full = leaf.grad.view(B, *out_shape)
                for q in range(plan.num_partitions):
                    box = plan.regions[-1][q]
                    if q != p and not box_empty(box):
                        self._send("output", q, (sid, "og"), crop(g_full, full_box(out_shape), box))
                g = crop(g_full, full_box(out_shape), h_box)
        if not backward:
            return loss, output

        for i in range(len(saved) - 1, -1, -1):
            own_leaf, own_part, leaves, out = saved[i]
            inputs = [t for t in self.params[i].values()] + ([own_leaf] if own_leaf is not None else []) + leaves
            if out.requires_grad and inputs:
                torch.autograd.backward(out, g, inputs=inputs)
            if i == 0:
                break
            # Each received box's gradient goes back to its owner, along the edge it came by.
            for t, leaf in zip(plan.recvs[i][p], leaves):
                self._send("backward", t.src, (sid, "b", i), leaf.grad if leaf.grad is not None
                           else torch.zeros_like(leaf))
            prev_box = plan.regions[i - 1][p]
            g = torch.zeros(B, plan.shapes[i][0], *box_size(prev_box))
            if own_leaf is not None and own_leaf.grad is not None:
                crop(g, prev_box, own_part).add_(own_leaf.grad)
            for t in plan.sends[i][p]:  # fixed order: sums are deterministic
                crop(g, prev_box, t.box).add_(self._recv(t.dst, (sid, "b", i)))
        return loss, output
