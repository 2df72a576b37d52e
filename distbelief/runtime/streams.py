"""A stream between one replica and one parameter shard on another node: gloo's TCP pairs (torch.distributed),
for the bulk bytes of pushes and fetches. The stream transport (runtime/transports/stream.py) uses it.

Why: Ray's object store moves a node's transfers one object at a time. Measured over 1 Gbit/s links with no
training at all (benchmarks/object_plane.py), the Downpour pattern kept every link at about 40 % both ways,
where gloo between the same actors reached about 65 % one exchange at a time and 94 % with two in flight.

What a stream is: a two-rank ``ProcessGroupGloo`` (rank 0 the replica, rank 1 the shard) built over a ``TCPStore``
the replica hosts. Bytes go one way per tag, in order: tag 0 carries the replica's pushes (a float32 vector of the
shard's range length), tag 1 the shard's fetch answers (the same length). Ray still carries every call, with its
ordering, failures and timeouts; only the arrays take the stream. The call says which push (or fetch) of the
stream it is, and the shard checks it against what it has received, so a lost message can never be matched to the
wrong call.

The shard's side keeps a receive posted at all times (a replica's send completes as soon as the bytes are across)
and sends fetch answers from a thread of its own. Its stream calls run in a concurrency group of their own: a call
waits for its push's bytes without holding the shard, then applies it under the actor's lock like any other call,
so one replica's push can arrive while another's fetch is answered and leaves. A replica that dies closes its end; the shard's threads see
the closed connection at once and drop the stream.
"""

from __future__ import annotations

import datetime
import queue
import socket
import threading
import time
from typing import Callable

import numpy as np

PUSH_TAG, FETCH_TAG = 0, 1
FOREVER = datetime.timedelta(days=365)  # the shard's background waits: they end when the replica's end closes


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (for the replica's rendezvous store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_store(host: str, port: int, is_master: bool, timeout_s: float):
    """The rendezvous store of one replica's streams: the replica hosts it (``is_master``), its shards join."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def open_pair(store, prefix: str, rank: int, node_ip: str, timeout_s: float, op_timeout=None):
    """Both ranks call this at once: a two-rank gloo group under ``prefix`` in ``store``, on this node's address
    (the namespaces of a shaped cluster have no usable hostname)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = op_timeout or datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, opts)


class StreamBroken(RuntimeError):
    """A stream can no longer be trusted (its peer died, a message was lost or came out of order)."""


class ShardEnd:
    """A shard's end of one replica's stream: a receiver thread that keeps one push receive posted, a sender
    thread for fetch answers. ``size`` float32 values each way (the shard's range)."""

    def __init__(self, pg, size: int, name: str, store=None):
        self.pg, self.size, self.name, self.store = pg, size, name, store
        self.received: queue.Queue = queue.Queue()  # (index, tensor) in arrival order, or (None, error)
        self.to_send: queue.Queue = queue.Queue()
        self.pushes_taken = 0
        self.pushes_applied = 0  # (the shard's actor counts them: ``applied``)
        self.fetches_sent = 0
        self._turns = threading.Condition()
        self.error: BaseException | None = None
        for target in (self._receive, self._send):
            threading.Thread(target=target, name=f"{name}-{target.__name__[1:]}", daemon=True).start()

    def _receive(self) -> None:
        import torch

        index = 0
        try:
            while self.pg is not None:
                buf = torch.empty(self.size, dtype=torch.float32)
                self.pg.recv([buf], 0, PUSH_TAG).wait(FOREVER)
                index += 1
                self.received.put((index, buf))
        except Exception as e:  # the replica closed its end (it finished or died)
            self.error = e
            self.received.put((None, e))

    def _send(self) -> None:
        while True:
            item = self.to_send.get()
            if item is None:
                return
            try:
                self.pg.send([item], 0, FETCH_TAG).wait(FOREVER)  # (AttributeError once closed)
            except Exception as e:
                self.error = e
                return

    def _turn(self, what: str, done: Callable[[], int], index: int, deadline: float) -> None:
        """Wait (until ``deadline``) for message ``index``'s turn: ``done()`` messages of its kind are through.
        Calls run concurrently on the shard (a fetch need not wait for another replica's push to arrive), so two
        of one stream's calls can start out of order; their messages cannot."""
        ok = self._turns.wait_for(lambda: done() >= index - 1, max(0.0, deadline - time.monotonic()))
        if done() >= index:
            raise StreamBroken(f"{self.name}: {what} {index} asked for twice")
        if not ok:
            raise StreamBroken(f"{self.name}: {what} {index} waited for {what} {index - 1}, which never came")

    def take_push(self, index: int, timeout_s: float) -> np.ndarray:
        """The stream's push number ``index`` (1, 2, ...), waiting at most ``timeout_s`` for its turn and bytes."""
        deadline = time.monotonic() + timeout_s
        with self._turns:
            self._turn("push", lambda: self.pushes_taken, index, deadline)
        try:
            got, buf = self.received.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise StreamBroken(f"{self.name}: push {index} did not arrive within {timeout_s:.0f}s") from None
        if got is None:
            self.received.put((None, buf))  # every later push sees it too
            raise StreamBroken(f"{self.name}: the replica's end closed ({buf})")
        if got != index:
            raise StreamBroken(f"{self.name}: received push {got} where push {index} was due")
        with self._turns:
            self.pushes_taken = index
            self._turns.notify_all()
        return buf.numpy()

    def applied(self, index: int) -> None:
        """The shard applied push ``index`` of this stream."""
        with self._turns:
            self.pushes_applied = max(self.pushes_applied, index)
            self._turns.notify_all()

    def await_applied(self, pushes: int, timeout_s: float) -> None:
        """Wait until the stream's first ``pushes`` pushes were applied: a fetch the replica sent after them sees
        them, as one caller's calls to a Ray actor run in order."""
        with self._turns:
            if not self._turns.wait_for(lambda: self.pushes_applied >= pushes, timeout_s):
                raise StreamBroken(f"{self.name}: a fetch waited {timeout_s:.0f}s for push {pushes} to be applied")

    def await_answered(self, fetches: int, timeout_s: float) -> None:
        """Wait until the stream's first ``fetches`` fetches were answered: a push the replica sent after them is
        not in their answers (the same order, the other way)."""
        with self._turns:
            if not self._turns.wait_for(lambda: self.fetches_sent >= fetches, timeout_s):
                raise StreamBroken(f"{self.name}: a push waited {timeout_s:.0f}s for fetch {fetches} to be answered")

    def send_fetch(self, index: int, values: np.ndarray, timeout_s: float) -> None:
        """Queue fetch answer number ``index`` (a copy of ``values``: the shard's live parameters change), after
        the answers before it."""
        import torch

        if self.error is not None:
            raise StreamBroken(f"{self.name}: {self.error}")
        if values.dtype != np.float32 or values.size != self.size:
            raise StreamBroken(f"{self.name}: a fetch answer of {values.size} {values.dtype} values, not {self.size}")
        copy = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
        with self._turns:
            self._turn("fetch", lambda: self.fetches_sent, index, time.monotonic() + timeout_s)
            self.to_send.put(copy)
            self.fetches_sent = index
            self._turns.notify_all()

    def close(self) -> None:
        """Let go of the stream (its connection closes once no transfer holds it)."""
        self.to_send.put(None)
        self.pg = None


class ReplicaEnd:
    """A replica's end of one shard's stream. ``push`` and ``fetch`` post the bytes' transfer and return its
    index (what the call to the shard names) and the gloo work; the caller waits on the work with its deadline,
    and keeps it until then (a transfer whose work is dropped is cancelled)."""

    def __init__(self, pg, size: int, name: str):
        self.pg, self.size, self.name = pg, size, name
        self.pushes = self.fetches = 0
        self._lock = threading.Lock()  # the order of posting is the order of indices

    def push(self, values: np.ndarray):
        import torch

        t = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))  # the caller may reuse its buffer
        with self._lock:
            self.pushes += 1
            return self.pushes, self.pg.send([t], 1, PUSH_TAG)

    def fetch(self):
        import torch

        buf = torch.empty(self.size, dtype=torch.float32)
        with self._lock:
            self.fetches += 1
            return self.fetches, self.pg.recv([buf], 1, FETCH_TAG), buf

    def close(self) -> None:
        """Let go of the stream: the connection closes once no transfer holds it, and the shard's end sees that
        (gloo's ``abort`` would leave the peer waiting)."""
        self.pg = None


def loopback_pair(size: int, name: str, timeout_s: float = 30.0) -> tuple:
    """Both ends of one stream of ``size`` values in this process, over loopback: ``(store, replica end, shard
    end)`` (the calibration's probe of a stream's CPU, and the tests). Keep the store while the ends are used."""
    host = "127.0.0.1"
    port = free_port(host)
    store = open_store(host, port, True, timeout_s)
    got = {}

    def shard_side():
        joined = open_store(host, port, False, timeout_s)
        got["shard"] = ShardEnd(open_pair(joined, name, 1, host, timeout_s, FOREVER), size, name, joined)

    t = threading.Thread(target=shard_side, daemon=True)
    t.start()
    replica = ReplicaEnd(open_pair(store, name, 0, host, timeout_s), size, name)
    t.join(timeout_s)
    return store, replica, got["shard"]


def wait(work, deadline: float, what: str) -> None:
    """Wait for a gloo transfer until ``deadline`` (time.monotonic); StreamBroken if it fails or is late."""
    left = max(0.001, deadline - time.monotonic())
    try:
        work.wait(datetime.timedelta(seconds=left))
    except Exception as e:
        raise StreamBroken(f"{what}: {e}") from e
