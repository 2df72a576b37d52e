"""How partitions of one replica hand each other tensors: a Transport (send/recv by key) and a Mailbox.

The partition logic talks only to :class:`Transport`. :class:`InProcessTransport` connects partitions running as
threads of one process; the Ray transport (actor to actor, numpy buffers) lives in
:mod:`distbelief.runtime.partition_ray`. Every receive waits with a timeout.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Hashable

import torch

from distbelief.exceptions import RemoteTimeoutError, RoleFailedError


class Transport(ABC):
    """Point-to-point tensor messages between the partitions of one replica.

    ``send`` never blocks on the receiver (the message is buffered at the destination); ``recv`` returns the
    tensor sent by ``src`` under ``key``, waiting at most ``timeout_s``.
    """

    partition_id: int

    @abstractmethod
    def send(self, dst: int, key: Hashable, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def recv(self, src: int, key: Hashable, timeout_s: float) -> torch.Tensor: ...


class Mailbox:
    """Messages delivered to one partition, keyed by ``(src, key)``. Thread-safe."""

    def __init__(self, owner: str):
        self.owner = owner
        self._items: dict[tuple[int, Any], Any] = {}
        self._cv = threading.Condition()
        self._error: BaseException | None = None

    def put(self, src: int, key: Hashable, value: Any) -> None:
        with self._cv:
            self._items[(src, key)] = value
            self._cv.notify_all()

    def take(self, src: int, key: Hashable, timeout_s: float) -> Any:
        with self._cv:
            ok = self._cv.wait_for(lambda: (src, key) in self._items or self._error is not None, timeout_s)
            if self._error is not None:
                raise self._error
            if not ok:
                raise RemoteTimeoutError(
                    f"{self.owner} waited {timeout_s:.0f}s for message {key!r} from partition {src} "
                    f"(raise remote_timeout_s if partitions are slow; a dead partition also causes this)")
            return self._items.pop((src, key))

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with ``error`` (a peer died or the replica is being torn down)."""
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def clear(self) -> None:
        with self._cv:
            self._items.clear()
            self._error = None


class InProcessTransport(Transport):
    """Partitions as threads of one process: a send copies the tensor into the destination's mailbox (a copy,
    so that no partition ever reads another partition's live buffers)."""

    def __init__(self, partition_id: int, mailboxes: list[Mailbox]):
        self.partition_id, self.mailboxes = partition_id, mailboxes

    def send(self, dst: int, key: Hashable, tensor: torch.Tensor) -> None:
        self.mailboxes[dst].put(self.partition_id, key, tensor.detach().clone())

    def recv(self, src: int, key: Hashable, timeout_s: float) -> torch.Tensor:
        return self.mailboxes[self.partition_id].take(src, key, timeout_s)

    @classmethod
    def group(cls, num_partitions: int, owner: str = "replica") -> list["InProcessTransport"]:
        boxes = [Mailbox(f"{owner} partition {p}") for p in range(num_partitions)]
        return [cls(p, boxes) for p in range(num_partitions)]

    def fail_all(self, error: BaseException | None = None) -> None:
        for box in self.mailboxes:
            box.fail(error or RoleFailedError("a partition of this replica failed"))
