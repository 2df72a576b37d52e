"""The stream transport: across nodes, a dense replica's pushes and fetches travel on a gloo stream per shard
(runtime/streams.py); the Ray call carries the rest of the operation and names which of the stream's messages it
is. Everything the stream does not carry — table rows, fp16 or delta fetches — goes the object store's way.

Failures fall back, never fail the run: a shard whose stream could not be opened, broke, or whose process was
replaced is served through the object store from then on (a replacement shard gets no stream). A call re-sent to a
replacement carries its arrays as arguments; a fetch answer lost on a broken stream is fetched again the same way.
"""

from __future__ import annotations

import secrets
import sys
import time

import ray

from distbelief.runtime import streams
from distbelief.runtime.base import Future
from distbelief.runtime.transports.calls import ShardCalls
from distbelief.runtime.transports.object_store import ObjectStoreTransport


class StreamTransport(ObjectStoreTransport):
    @property
    def name(self) -> str:
        """``stream``, or how many shards still have one (the others: the object store), for the run's summary."""
        n, m = len(self.ends), self.streamed()
        return "stream" if m == n else f"stream ({m} of {n} shards)"

    def __init__(self, client, timeout_s: float):
        super().__init__(client, single_node=False)
        self.timeout_s = timeout_s
        self.ranges = [client.layout.range(k) for k in range(len(client.handles))]
        self.ends: list[streams.ReplicaEnd | None] = [None] * len(client.handles)
        self.prefixes: list[str] = [""] * len(client.handles)
        self.store = None
        self._open()

    def _open(self) -> None:
        """A stream to every shard; a shard whose stream fails to open is served through the object store."""
        c = self.client
        host = ray.util.get_node_ip_address()
        try:
            port = streams.free_port(host)
            self.store = streams.open_store(host, port, True, self.timeout_s)
        except Exception as e:  # no stream at all: the object store serves every shard
            _warn(f"replica {c.replica_id}: no stream to the shards ({e}); using the object store")
            return
        token = secrets.token_hex(4)
        for k, handle in enumerate(c.handles):
            lo, hi = self.ranges[k]
            prefix = f"r{c.replica_id}-s{k}-{token}"
            opened = handle.stream_open.remote(prefix, host, port, hi - lo, self.timeout_s)
            try:
                pg = streams.open_pair(self.store, prefix, 0, host, self.timeout_s)
                ray.get(opened, timeout=self.timeout_s)
            except Exception as e:
                _warn(f"replica {c.replica_id}: no stream to parameter shard {k} ({e}); using the object store")
                continue
            self.ends[k], self.prefixes[k] = streams.ReplicaEnd(pg, hi - lo, f"stream to shard {k}"), prefix

    def streamed(self) -> int:
        """How many shards this replica reaches by stream (the run's summary)."""
        return sum(e is not None for e in self.ends)

    def _drop(self, k: int, why: str) -> None:
        """Serve shard ``k`` through the object store from now on (one warning saying ``why``)."""
        end, self.ends[k] = self.ends[k], None
        if end is not None:
            end.close()
            _warn(f"replica {self.client.replica_id}: parameter shard {k} is served through the object store from "
                  f"now on ({why})")

    def replace_shard(self, shard_id: int, handle) -> int:
        self._drop(shard_id, "the shard was replaced")
        return super().replace_shard(shard_id, handle)

    def _plain_fetch(self) -> bool:
        c = self.client
        return c.fetch_since is None and not c.fetch_half

    def fetch(self) -> Future:
        if not self._plain_fetch() or not any(self.ends):
            return super().fetch()
        return StreamCalls(self, "fetch", push=None, fetch=True)

    def push(self, g, versions, num_examples, seq, rows) -> Future:
        if rows is not None or not any(self.ends):
            return super().push(g, versions, num_examples, seq, rows)
        return StreamCalls(self, "push", push=(g, versions, num_examples, seq), fetch=False)

    def push_fetch(self, g, versions, num_examples, seq, rows) -> Future:
        if rows is not None or not self._plain_fetch() or not any(self.ends):
            return super().push_fetch(g, versions, num_examples, seq, rows)
        return StreamCalls(self, "push+fetch", push=(g, versions, num_examples, seq), fetch=True)


class StreamCalls(ShardCalls):
    """One operation (a push, a fetch, or both) to every shard: by stream where the shard has one, else, and for
    any call re-sent to a replacement, the object store's call. ``result`` has the object store's shape: a push's
    versions, a fetch's ``(parts, versions)``, or ``(versions, (parts, versions))`` for both."""

    def __init__(self, transport: StreamTransport, method: str, push, fetch: bool):
        t, c = transport, transport.client
        self.transport, self.has_push, self.has_fetch = t, push is not None, fetch
        n = len(c.handles)
        fetch_args = c.fetch_args()
        # The object store's call per shard: the first send where there is no stream, and every re-send.
        if push is not None:
            g, versions, num_examples, seq = push
            push_args = t._push_args(g, versions, num_examples, seq, None)
        if push is not None and fetch:
            self.fallback = {k: ("push_fetch", (len(push_args[k]), *push_args[k], *fetch_args[k])) for k in range(n)}
        elif push is not None:
            self.fallback = {k: ("call", ("push", *push_args[k])) for k in range(n)}
        else:
            self.fallback = {k: ("call", ("fetch", *fetch_args[k])) for k in range(n)}
        # By stream: post the bytes' transfers first (in the order of their indices), then the calls naming them.
        self.streamed: dict[int, tuple] = {}  # shard -> (push work, fetch work, fetch buffer)
        stream_sends = {}
        for k in range(n):
            end = t.ends[k]
            if end is None:
                continue
            lo, hi = t.ranges[k]
            try:
                push_index, push_work = end.push(g[lo:hi]) if push is not None else (0, None)
                fetch_index, fetch_work, buf = end.fetch() if fetch else (0, None, None)
            except Exception as e:  # a broken pair: this shard goes the object store's way
                t._drop(k, str(e))
                continue
            tail = (c.replica_id, lo, versions[k], num_examples, c.session, seq) if push is not None else ()
            if push is not None and fetch:
                stream_sends[k] = ("push_fetch_stream", (t.prefixes[k], push_index, fetch_index, *tail))
            elif push is not None:  # (after the fetches this replica sent before it, and a fetch after the pushes
                # before it: the order Ray keeps for one caller's calls to an actor)
                stream_sends[k] = ("push_stream", (t.prefixes[k], push_index, end.fetches, *tail))
            else:
                stream_sends[k] = ("fetch_stream", (t.prefixes[k], fetch_index, end.pushes, c.replica_id))
            self.streamed[k] = (push_work, fetch_work, buf)
        self.first = {k: stream_sends.get(k, self.fallback[k]) for k in range(n)}
        self._sent: set[int] = set()
        super().__init__(c, method, self.first)

    def _send(self, k: int):
        if k in self._sent:  # a re-send (a replacement, or a lost reply): the object store's call
            if k in self.streamed:
                self.streamed.pop(k)
                self.transport._drop(k, f"{self.method} re-sent")
            self.sends[k] = self.fallback[k]
        self._sent.add(k)
        return super()._send(k)

    def _send_again_after(self, k: int, error) -> bool:
        """A stream call that failed on the stream (its bytes did not come, or the shard was replaced under it) is
        sent again the object store's way; a push it already applied is recognised by its sequence number."""
        broken = isinstance(error, streams.StreamBroken) or isinstance(getattr(error, "cause", None),
                                                                        streams.StreamBroken)
        return k in self.streamed and broken

    def result(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        replies = super().result(timeout_s)
        versions_pushed, parts, fetched_versions = [], [], []
        for k, reply in enumerate(replies):
            lo = self.transport.ranges[k][0]
            if k not in self.streamed:  # the object store's shape
                pushed, answer = (reply if self.has_fetch else (reply, None)) if self.has_push else (None, reply)
            else:
                push_work, fetch_work, buf = self.streamed[k]
                pushed, version = (reply if self.has_fetch else (reply, None)) if self.has_push else (None, reply)
                answer = None
                try:
                    if push_work is not None:
                        streams.wait(push_work, deadline, f"push to parameter shard {k}")
                    if fetch_work is not None:
                        streams.wait(fetch_work, deadline, f"fetch from parameter shard {k}")
                        answer = (buf.numpy(), version)
                except streams.StreamBroken as e:
                    self.transport._drop(k, str(e))
                    if self.has_fetch:  # the shard answered; its bytes were lost on the way: ask again
                        answer = _refetch(self.transport, k, deadline)
            versions_pushed.append(pushed)
            if self.has_fetch:
                parts.append((lo, answer[0]))
                fetched_versions.append(answer[1])
        if self.has_push and self.has_fetch:
            return versions_pushed, (parts, fetched_versions)
        return versions_pushed if self.has_push else (parts, fetched_versions)


def _refetch(t: StreamTransport, k: int, deadline: float):
    c = t.client
    return ShardCalls(c, "fetch", {k: ("call", ("fetch", *c.fetch_args()[k]))}).result(
        max(0.0, deadline - time.monotonic()))[0]


def _warn(message: str) -> None:
    print(f"[distbelief] warning: {message}", file=sys.stderr, flush=True)
