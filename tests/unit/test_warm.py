"""The warm pool's bookkeeping (runtime/warm.py): which idle role process serves which request, which are stopped."""

from distbelief.runtime.warm import WarmKey, WarmPool

SHARD = WarmKey(stream_calls=8, num_cpus=0.0, num_gpus=0.0, max_concurrency=1)
REPLICA = WarmKey(stream_calls=1, num_cpus=1.0, num_gpus=0.0, max_concurrency=4)
HALF_REPLICA = WarmKey(stream_calls=1, num_cpus=0.5, num_gpus=0.0, max_concurrency=4)


def test_a_process_serves_only_a_request_with_equal_options_and_only_once():
    pool = WarmPool()
    assert pool.give("ray-a", [(SHARD, "s0"), (SHARD, "s1"), (REPLICA, "r0")]) == []
    assert pool.take("ray-a", HALF_REPLICA) is None  # other CPUs: another process
    assert pool.take("ray-a", WarmKey(9, 0.0, 0.0, 1)) is None  # another class (stream threads)
    assert pool.take("ray-a", REPLICA) == "r0"
    assert pool.take("ray-a", REPLICA) is None
    assert {pool.take("ray-a", SHARD), pool.take("ray-a", SHARD)} == {"s0", "s1"}
    assert pool.size("ray-a") == 0


def test_resources_held_and_evicted():
    assert not SHARD.holds_resources
    assert REPLICA.holds_resources
    assert WarmKey(1, 0.0, 1.0, 4).holds_resources
    assert WarmKey(8, 0.0, 0.0, 1, resources=(("distbelief_shard", 0.001),)).holds_resources
    pool = WarmPool()
    pool.give("ray-a", [(SHARD, "s0"), (REPLICA, "r0"), (REPLICA, "r1")])
    assert pool.idle_cpus("ray-a") == 2.0
    assert sorted(pool.evict("ray-a")) == ["r0", "r1"]  # those that hold resources
    assert pool.idle_cpus("ray-a") == 0.0 and pool.size("ray-a") == 1
    assert pool.evict("ray-a", holding_only=False) == ["s0"]
    assert pool.size("ray-a") == 0


def test_the_pool_holds_one_runs_processes_the_rest_are_handed_back_to_stop():
    pool = WarmPool()
    pool.give("ray-a", [(SHARD, "s0"), (SHARD, "s1"), (REPLICA, "r0")])
    assert pool.take("ray-a", SHARD) == "s0"  # the next run takes one shard's process, starts the rest anew
    assert sorted(pool.give("ray-a", [(SHARD, "s0"), (SHARD, "s2")])) == ["r0", "s1"]
    assert pool.size("ray-a") == 2


def test_another_ray_instance_forgets_the_processes_of_the_last():
    pool = WarmPool()
    pool.give("ray-a", [(SHARD, "s0")])
    assert pool.take("ray-b", SHARD) is None  # "ray-a" was shut down: its processes went with it
    assert pool.size("ray-a") == 0
    assert pool.give("ray-b", [(SHARD, "t0")]) == []
