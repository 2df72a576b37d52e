"""The stream between a replica and a shard (runtime/streams.py), both ends in this process over loopback: bytes
arrive exactly and in order, a message named out of order or a closed end is a StreamBroken error at once, never a
wrong array."""

import gc
import threading
import time

import numpy as np
import pytest

from distbelief.runtime import streams


def _pair(size: int):
    return streams.loopback_pair(size, "p")


def test_pushes_and_fetches_arrive_exactly_in_order():
    store, replica, shard = _pair(1000)
    rng = np.random.default_rng(0)
    sent = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    works = [replica.push(v) for v in sent]
    assert [i for i, _ in works] == [1, 2, 3]
    for i, v in enumerate(sent, 1):
        assert np.array_equal(shard.take_push(i, 10), v)
    for _, w in works:
        streams.wait(w, time.monotonic() + 10, "push")
    answer = rng.standard_normal(1000).astype(np.float32)
    index, work, buf = replica.fetch()
    shard.send_fetch(index, answer, 10)
    answer_copy = answer.copy()
    answer[:] = 0  # the shard's live values change after it answered: the answer was a copy
    streams.wait(work, time.monotonic() + 10, "fetch")
    assert index == 1 and np.array_equal(buf.numpy(), answer_copy)
    replica.close()
    shard.close()


def test_calls_out_of_order_wait_for_their_turn():
    """Two calls of one stream may start on the shard out of order (its stream calls run concurrently); each
    takes its own message: push 2's call, started first, waits for push 1's."""
    store, replica, shard = _pair(4)
    works = [replica.push(np.full(4, v, np.float32)) for v in (1.0, 2.0)]  # (a send lives as long as its work)
    got = {}
    second = threading.Thread(target=lambda: got.setdefault(2, shard.take_push(2, 10)))
    second.start()
    time.sleep(0.1)  # (only to let the second call start first; the result does not depend on it)
    got[1] = shard.take_push(1, 10)
    second.join(10)
    assert got[1].tolist() == [1.0] * 4 and got[2].tolist() == [2.0] * 4
    for _, w in works:
        streams.wait(w, time.monotonic() + 10, "push")
    replica.close()
    shard.close()


def test_a_message_named_out_of_order_or_of_the_wrong_size_is_refused():
    store, replica, shard = _pair(10)
    work = replica.push(np.ones(10, np.float32))[1]
    with pytest.raises(streams.StreamBroken, match="push 2 waited for push 1, which never came"):
        shard.take_push(2, 0.2)
    with pytest.raises(streams.StreamBroken, match="fetch 2 waited for fetch 1"):
        shard.send_fetch(2, np.ones(10, np.float32), 0.2)
    with pytest.raises(streams.StreamBroken, match="5 float32 values, not 10"):
        shard.send_fetch(1, np.ones(5, np.float32), 10)
    assert np.array_equal(shard.take_push(1, 10), np.ones(10, np.float32))
    with pytest.raises(streams.StreamBroken, match="push 1 asked for twice"):
        shard.take_push(1, 10)
    with pytest.raises(streams.StreamBroken, match="did not arrive within"):
        shard.take_push(2, 0.2)
    streams.wait(work, time.monotonic() + 10, "push")
    replica.close()
    shard.close()


def test_a_closed_replica_end_breaks_the_shard_end_at_once():
    store, replica, shard = _pair(10)
    replica.close()  # (as its process's exit would: the connection closes)
    gc.collect()
    t0 = time.monotonic()
    with pytest.raises(streams.StreamBroken, match="closed"):
        shard.take_push(1, 30)
    assert time.monotonic() - t0 < 30  # the closed connection, not the timeout
    assert shard.error is not None
    shard.close()


def test_a_fetch_waits_for_the_pushes_its_replica_sent_before_it_and_a_push_for_the_fetches():
    store, replica, shard = _pair(4)
    shard.await_applied(0, 0.1)  # nothing sent before: at once
    with pytest.raises(streams.StreamBroken, match="waited 0s for push 1 to be applied"):
        shard.await_applied(1, 0.1)
    waiting = threading.Thread(target=shard.await_applied, args=(2, 10))
    waiting.start()
    shard.applied(1)
    shard.applied(2)
    waiting.join(10)
    assert not waiting.is_alive() and shard.pushes_applied == 2
    # ... and a push waits for the fetches its replica sent before it to be answered
    with pytest.raises(streams.StreamBroken, match="waited 0s for fetch 1 to be answered"):
        shard.await_answered(1, 0.1)
    index, work, buf = replica.fetch()
    waiting = threading.Thread(target=shard.await_answered, args=(1, 10))
    waiting.start()
    shard.send_fetch(index, np.zeros(4, np.float32), 10)
    waiting.join(10)
    streams.wait(work, time.monotonic() + 10, "fetch")
    assert not waiting.is_alive() and shard.fetches_sent == 1
    replica.close()
    shard.close()
