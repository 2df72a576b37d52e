"""``calibrate`` (distbelief/simulate/calibrate.py) measures every cost on this machine with the project's
code paths, Ray and a fake two-node cluster included, leaves no Ray behind, and writes a file that ``Costs``
reads back."""

import json
import math

import pytest
import ray

from distbelief.simulate.calibrate import STEP_BATCHES, STEP_MODELS, calibrate
from distbelief.simulate.costs import Costs

pytestmark = [pytest.mark.ray]

# Costs.check's rules: these divide (> 0); every other number may be 0 but not negative
RATES = ("copy_bytes_per_s", "objstore_bytes_per_s", "link_efficiency")


def _numbers(costs: Costs) -> dict[str, float]:
    """Every cost as ``field``, ``field[key]`` or ``field[key][key]``."""
    out = {}

    def add(name, value):
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{name}[{k}]", v)
        else:
            out[name] = value

    for name, value in costs.to_json().items():
        if name not in ("machine", "date", "measurements"):
            add(name, value)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_calibration_measures_every_cost_and_reads_back(tmp_path):
    ray.shutdown()
    path = tmp_path / "costs.json"
    lines = []
    costs = calibrate(path, quick=True, log=lines.append)

    assert not ray.is_initialized()
    numbers = _numbers(costs)
    assert set(numbers) >= {"macs_per_s[dense]", "macs_per_s[local]", "macs_per_s[other]",
                            "update_s_per_value[sgd]", "update_s_per_value[adagrad]",
                            *(f"{d}_s_per_value[{s}]" for d in ("encode", "decode")
                              for s in ("fp16", "topk", "qsgd", "powersgd"))}
    for name, value in numbers.items():
        assert isinstance(value, (int, float)) and math.isfinite(value), (name, value)
        positive = name in RATES or name == "cpus" or name.startswith("macs_per_s")
        assert value > 0 if positive else value >= 0, (name, value)
    # what the fits cannot leave at 0: a measured time per call, per value or per byte
    for name in ("call_s", "call_cpu_s", "objstore_call_s", "objstore_cpu_s_per_byte", "delta_s_per_value",
                 "update_s_per_value[sgd]", "update_s_per_value[adagrad]", "sparse_push_s_per_value",
                 "delta_log_s_per_value", "stream_cpu_s_per_byte", "local_object_cpu_s_per_byte",
                 "delta_load_s_per_value"):
        assert numbers[name] > 0, name
    # every step timed is kept as its model's own, the 42M speech model's too
    assert {k for k in numbers if k.startswith("step_measured")} >= {
        "step_measured[speech-tiny:2284032][128]", "step_measured[speech-paper:41777152][32]"}
    assert costs.machine and costs.date and costs.cpus >= 1
    m = costs.measurements
    steps = len(STEP_MODELS) * len(STEP_BATCHES)
    assert len(m["steps"]) == steps and len(m["objstore"]) == 3 and m["quick"] is True
    assert m["contention"]["contention"] == costs.contention >= 1
    assert len(m["contention"]["turns"]) == 3  # alone then together, three times: the median ratio kept
    assert costs.compute_cv > 0 and m["threads"]["efficiency"] == costs.thread_efficiency  # 2 cores or more
    # CPU that this machine could have spent: no more than its cores over the wall time it was timed for (a
    # probe that read two different clocks once put a call's CPU at 27.7 s for a call of 1.4 ms)
    for rec in m["call"]:
        assert 0 <= rec["cpu_s"] <= costs.cpus * 3 * rec["seconds"] + 0.01, rec
    assert costs.objstore_cpu_s <= costs.cpus * 3 * costs.objstore_call_s + 0.01
    # the compressed calls: values loaded, and the call's cost beyond what the simulator charges elsewhere
    c = m["compressed"]
    assert c["loaded"] > 0 and c["push_bytes"] > 0 and c["answer_bytes"] > 0 and c["rounds"] >= 20
    assert costs.encoded_call_cpu_s == max(0.0, c["per_call_cpu_s"] - c["charged_s"])
    # real Downpour runs, shards co-located and in processes of their own: a step each, and their ratio
    layout = m["layout"]
    assert [len(layout["steps_s"][k]) for k in ("colocated", "separate")] == [1, 1]
    apart, together = layout["steps_s"]["separate"][0], layout["steps_s"]["colocated"][0]
    assert together > 0 and costs.separate_process_slowdown == max(1.0, apart / together)
    # a real model-parallel run (2 partitions): its step, less the model's step without messages, per message
    parts = m["partitions"]
    assert len(parts["steps_s"]) == 1 and parts["messages_on_path"] == 6  # 2 layers' exchanges x 2, gather, scatter
    assert costs.partition_message_s == max(0.0, parts["steps_s"][0] - parts["modelled_without_messages_s"]) / 6
    # and each partition process's CPU in a step: some, and (2 cores, one partition on each) at most the step
    assert len(parts["cpu_s_per_step"]) == 1 and 0 < parts["cpu_s_per_step"][0] <= 1.5 * parts["steps_s"][0]

    assert Costs.from_json(json.loads(path.read_text()), str(path)) == costs
    # one line per measurement: every step, one with 1 and 2 threads, the 42M model's own, their fit; the
    # co-located steps alone and beside another; 2 rules; 4 schemes; the compressed calls; 3 object sizes and
    # their fit; a Downpour run per layout and their ratio; a model-parallel run and its messages' cost
    counts = {"step ": steps + 1 + 1 + 1, "co-located step": 1, "thread efficiency": 1, "shard update": 2,
              "delta fetch": 1, "sparse push": 1, "copy": 1, "stream": 1, "compression": 4, "Ray actor call": 1,
              "object store": 3 + 1, "compressed calls": 1, "Downpour 2 x 2": 2, "shards in processes": 1,
              "speech-tiny batch 128 over 2 partitions": 1, "a message between partitions": 1}
    # (the steps are timed again, each logged again, when noise left their first timing no fit)
    counts["step "] += steps * sum(line.startswith("the steps do not fit") for line in lines)
    assert {k: sum(line.startswith(k) for line in lines) for k in counts} == counts


@pytest.mark.slow
def test_probes_share_the_local_ray_that_local_ray_keeps_up_and_leave_none_of_their_actors():
    """Inside ``local_ray`` a probe uses that instance, and kills the actors it made when it is done (outside
    it, a probe starts an instance of its own and shuts it down after)."""
    import numpy as np

    from distbelief.ps.rules import make_rule
    from distbelief.ps.shard import ParameterShard
    from distbelief.runtime.probes import local_ray, with_actors

    shard = (ParameterShard, (0, 0, 4, np.arange(4, dtype=np.float32), make_rule("sgd", lr=0.1), 4))

    def fetch(handles):
        values, _version = ray.get(handles[0].call.remote("fetch", 0))
        return list(values)

    ray.shutdown()
    with local_ray():
        node = ray.get_runtime_context().get_node_id()
        made = []
        assert with_actors([shard], lambda hs: made.extend(hs) or fetch(hs)) == [0, 1, 2, 3]
        assert ray.is_initialized() and ray.get_runtime_context().get_node_id() == node  # the same instance
        with pytest.raises(ray.exceptions.RayActorError):  # killed
            ray.get(made[0].call.remote("stats"), timeout=60)
    assert not ray.is_initialized()
