"""The shaped cluster on one machine (distbelief/runtime/netcluster.py, `distbelief cluster up | down | status`):
Ray nodes in their own network namespaces on a bridge, every link shaped with tc.

The tests that make namespaces need Linux and root and skip elsewhere, saying why; the checks of bad flags and
of the refusal off Linux or without root run everywhere (nothing is made before them). Each cluster here has its
own name and subnet, so a cluster someone left up (default name dbnet, 10.77.0) is never touched."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distbelief import cli
from distbelief.exceptions import ConfigError
from distbelief.runtime import netcluster as nc
from distbelief.runtime.ray_settings import SYSTEM_CONFIG

PY = [sys.executable, "-m", "distbelief.cli"]


def _why_not_here() -> str | None:
    """Why this machine cannot make a shaped cluster, or None."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux (network namespaces, veth, tc); this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root: it creates network namespaces, a bridge and tc qdiscs"
    for tool in (["ip", "netns", "list"], ["tc", "qdisc", "show", "dev", "lo"]):
        try:
            r = subprocess.run(tool, capture_output=True, text=True, timeout=10, check=False)
        except (FileNotFoundError, subprocess.TimeoutExpired) as e:
            return f"`{' '.join(tool)}` unavailable: {e}"
        if r.returncode != 0:
            return f"`{' '.join(tool)}` failed: {r.stderr.strip()}"
    return None


WHY_NOT = _why_not_here()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def _has_netem() -> bool:
    """Whether this kernel has the netem qdisc (--delay); tried in a throwaway namespace of one process."""
    r = subprocess.run(["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                       capture_output=True, text=True, timeout=10, check=False)
    return r.returncode == 0


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # nothing but what a user has


def _last_record(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def _assert_gone(name: str, pids: list[int]) -> None:
    """(b): nothing of the cluster is left: namespace, veth, bridge, process, state file."""
    assert nc.leftovers(name) == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"{name}-" not in netns
    assert not [link for link in os.listdir("/sys/class/net") if link.startswith(f"{name}-")]
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists() and nc._alive(pid)]
    assert not nc.state_path(name).exists()


# ---------------------------------------------------------------------------------------------- everywhere


@pytest.mark.parametrize("flags, flag", [
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "2", "--bandwidth", "0"], "--bandwidth"),
    (["--nodes", "2", "--bandwidth", "1gbps"], "--bandwidth"),
    (["--nodes", "2", "--delay=-1ms"], "--delay"),
    (["--nodes", "2", "--delay", "5"], "--delay"),
    (["--nodes", "2", "--name", "Has_Caps"], "--name"),
    (["--nodes", "2", "--name", "waytoolongname"], "--name"),
    (["--nodes", "2", "--shard-nodes", "2"], "--shard-nodes"),
    (["--nodes", "2", "--cpus-per-node", "-1"], "--cpus-per-node"),
    (["--nodes", "2", "--subnet", "8.8.8"], "--subnet"),
    (["--nodes", "2", "--timeout-s", "0"], "--timeout-s"),
])
def test_bad_flags_are_refused_naming_the_flag_before_anything_is_made(flags, flag, capsys):
    before = sorted(os.listdir("/sys/class/net")) if sys.platform.startswith("linux") else []
    assert cli.main(["cluster", "up", "--name", "dbflags"] + flags) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err, err
    if before:
        assert sorted(os.listdir("/sys/class/net")) == before
    assert not nc.state_path("dbflags").exists()


def test_refused_without_root_or_off_linux_saying_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(nc.NetClusterError, match="needs root"):
        nc.up("dbroot", nodes=2)
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(nc.NetClusterError, match="needs Linux.*darwin"):
        nc.down("dbroot")


def test_rates_and_delays_parse_as_tc_writes_them():
    assert nc.parse_rate("1gbit") == 10**9 and nc.parse_rate("100mbit") == 10**8
    assert nc.parse_rate("2.5gbit") == 2_500_000_000
    assert nc.parse_delay("1ms") == pytest.approx(1e-3) and nc.parse_delay("0") == 0
    assert nc.parse_delay("250us") == pytest.approx(250e-6)
    with pytest.raises(ConfigError, match="bandwidth"):
        nc.parse_rate("1gbps")  # bytes per second in tc's words: refused, not silently 8x
    c = nc.plan("dbplan", nodes=4, shard_nodes=2, cpus_per_node=2)
    assert [n.cpus for n in c.nodes] == [2, 2, 0, 0]
    assert [n.resources for n in c.nodes] == [{}, {}, {nc.SHARD_RESOURCE: 1}, {nc.SHARD_RESOURCE: 1}]
    assert c.address == "10.77.0.10:6379" and [n.netns for n in c.nodes][-1] == "dbplan-n3"


def test_the_head_starts_with_the_local_instances_ray_settings_and_the_other_nodes_join_it():
    """The cluster's nodes run with what a local instance gets (runtime/ray_settings.py): above all a 512 KiB
    inline limit, without which a ~108 KB compressed part went through the object store and now and then waited
    a second. The head is given them; a joining node takes them from the head (the slow test below checks that
    it did)."""
    c = nc.plan("dbplan", nodes=3, shard_nodes=1, cpus_per_node=1)
    head, other = nc._ray_start_command(c, c.nodes[0]), nc._ray_start_command(c, c.nodes[1])
    flag = [a for a in head if a.startswith("--system-config=")]
    assert len(flag) == 1 and json.loads(flag[0].split("=", 1)[1]) == SYSTEM_CONFIG
    assert SYSTEM_CONFIG["max_direct_call_object_size"] == 512 * 1024 and "--head" in head
    assert f"--address={c.address}" in other and not [a for a in other if a.startswith("--system-config")]


def test_a_machine_without_a_ray_token_gets_one_before_the_head_starts(tmp_path, monkeypatch):
    """A fresh machine (no local Ray has run: no ~/.ray/auth_token) had its head start with authentication off
    and every joining node fail; `up` now makes the token first, with Ray's own command, and keeps one it finds."""
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    said = []
    nc._ensure_token(said.append)
    token = (tmp_path / ".ray" / "auth_token").read_text().strip()
    assert len(token) >= 32 and len(said) == 1 and str(tmp_path / ".ray" / "auth_token") in said[0]
    nc._ensure_token(said.append)
    assert (tmp_path / ".ray" / "auth_token").read_text().strip() == token and len(said) == 1
    assert nc._ray_env()["RAY_AUTH_MODE"] == "token"  # every node's, the head's too


# ------------------------------------------------------------------------------------------ Linux and root


# Run in the head's namespace: how many nodes' object stores hold a reply of each size made on the node at argv[2]
INLINE_PROBE = """
import json, sys
import numpy as np, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1])
(node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == sys.argv[2]]
make = ray.remote(lambda n: np.zeros(n // 8)).options(
    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
held = {}
for size in (300_000, 600_000):
    ref = make.remote(size)
    ray.get(ref, timeout=60)
    held[str(size)] = len(ray.experimental.get_object_locations([ref])[ref]["node_ids"])
print(json.dumps(held))
"""


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(300)
def test_a_downpour_run_over_shaped_links_moves_the_bytes_its_counters_say(tmp_path):
    """Up a 3-node cluster (1 Gbit/s links; 1 ms of delay where the kernel has netem): node 0 the head, where the
    driver runs; node 1 a general node; node 2 a dedicated shard node (the distbelief_shard resource, no CPUs), so
    the shard is there and no replica is. A Downpour run (2 replicas on nodes 0 and 1, 1 shard) joins with
    --address from the head's namespace, exactly as on a real cluster.

    What is compared: every byte to or from the shard crosses node 2's link, and nothing else of the run does. So
    the TCP payload that entered node 2 over the run (the kernel's counters on its veth, minus 66 header bytes
    per packet; see netcluster.payload_bytes) must equal, within 5 %, the gradient bytes the shard read
    (metrics.jsonl's final bytes_pushed), and the payload that left it the parameter bytes it served
    (bytes_fetched: the replicas' fetches and the driver's evaluation reads). Ray's own traffic on that link
    (heartbeats, resource reports) is measured first while idle, as a rate, and subtracted for the run's
    duration; what remains of Ray's is per call (task specs, object-transfer headers): small against a 315 KB
    parameter vector. Then (b): `cluster status` sees the cluster; the head's Ray settings reached a joined node
    (a 300 KB reply made there goes inline); a node whose processes are all killed is seen as not whole; `down`
    leaves no namespace, veth, bridge, process or state file, and a second `down` is a no-op."""
    name, subnet = "dbtest", "10.78.0"
    delay = "1ms" if _has_netem() else "0"
    r = subprocess.run(PY + ["cluster", "up", "--name", name, "--subnet", subnet, "--nodes", "3", "--bandwidth",
                             "1gbit", "--delay", delay, "--cpus-per-node", "1", "--shard-nodes", "1"],
                       env=_env(), capture_output=True, text=True, timeout=240, check=False)
    pids: list[int] = []
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        address = r.stdout.strip()
        assert address == f"{subnet}.10:6379"
        c = nc.load(name)
        pids = [n.pid for n in c.nodes]
        shard_node = c.nodes[2]
        assert shard_node.cpus == 0 and shard_node.resources == {nc.SHARD_RESOURCE: 1}

        idle_start, t0 = nc.link_counters(name)[2], time.monotonic()
        time.sleep(3)  # a measurement window, not a wait for anything
        idle, idle_s = nc.link_counters(name)[2] - idle_start, time.monotonic() - t0

        out = tmp_path / "run"
        start, t0 = nc.link_counters(name)[2], time.monotonic()
        run = subprocess.run(["ip", "netns", "exec", c.nodes[0].netns] + PY + [
            "train", "--address", address, "--replicas", "2", "--shards", "1", "--num-samples", "2000",
            "--max-steps", "60", "--max-seconds", "0", "--eval-every-seconds", "2", "--out", str(out)],
            env=_env(), capture_output=True, text=True, timeout=240, check=False)
        moved, run_s = nc.link_counters(name)[2] - start, time.monotonic() - t0
        assert run.returncode == 0, run.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["runtime"] == "ray" and summary["steps_per_replica"] == [60, 60]
        assert summary["replica_transports"] == {"stream": 2}  # across nodes: the gloo streams

        rec = _last_record(out)
        pushed, fetched = rec["bytes_pushed"], rec["bytes_fetched"]
        into = moved.to_node_payload - idle.to_node_payload / idle_s * run_s
        out_of = moved.from_node_payload - idle.from_node_payload / idle_s * run_s
        report = (f"into shard node {into:,.0f} B vs pushed {pushed:,} B; out of it {out_of:,.0f} B vs fetched "
                  f"{fetched:,} B (idle {idle.to_node_bytes / idle_s:,.0f} / {idle.from_node_bytes / idle_s:,.0f} "
                  f"B/s in / out, run {run_s:.1f} s)")
        print(report)
        assert pushed >= 120 * summary["num_parameters"] * 4, report  # 2 replicas x 60 pushes of every parameter
        assert abs(into - pushed) <= 0.05 * pushed, report
        assert abs(out_of - fetched) <= 0.05 * fetched, report

        st = subprocess.run(PY + ["cluster", "status", "--name", name, "--json"], capture_output=True, text=True,
                            timeout=60, check=True)
        (seen,) = json.loads(st.stdout)
        assert seen["up"] and seen["address"] == address and all(n["alive"] for n in seen["nodes"])

        # the head's settings reached the node that joined it: a 300 KB reply from node 1 travels inline (no
        # node holds it in its object store), a 600 KB one through the store (runtime/ray_settings.py); with Ray's
        # default 100 KiB both were held in stores
        probe = subprocess.run(["ip", "netns", "exec", c.nodes[0].netns, sys.executable, "-c", INLINE_PROBE,
                                address, c.nodes[1].ip], env={**_env(), "RAY_AUTH_MODE": "token"},
                               capture_output=True, text=True, timeout=120, check=False)
        assert probe.returncode == 0, probe.stderr[-3000:]
        held = json.loads(probe.stdout.strip().splitlines()[-1])
        assert held["300000"] == 0 and held["600000"] >= 1, probe.stdout  # (1 or 2: the driver's copy, once read)

        # a node dies (every process in its namespace): the cluster is no longer whole, `down` still cleans up
        node1 = nc._netns_pids(c.nodes[1].netns)
        pids += node1
        nc._signal(node1, signal.SIGKILL)
        assert nc._wait_until(lambda: not nc._netns_pids(c.nodes[1].netns), 10)
        assert nc.status(name)[0]["up"] is False
    finally:
        pids += [p for n in (nc.load(name).nodes if nc.state_path(name).exists() else []) for p in
                 nc._netns_pids(n.netns)]
        down = subprocess.run(PY + ["cluster", "down", "--name", name], capture_output=True, text=True, timeout=120,
                              check=False)
    assert down.returncode == 0, down.stderr
    _assert_gone(name, pids)
    again = subprocess.run(PY + ["cluster", "down", "--name", name], capture_output=True, text=True, timeout=60,
                           check=False)
    assert again.returncode == 0 and "nothing to remove" in again.stderr


@needs_netns
def test_a_delay_the_kernel_cannot_make_is_refused_naming_delay_before_anything_is_made(capsys):
    if _has_netem():
        pytest.skip("this kernel has netem: --delay works (the run test uses it)")
    assert cli.main(["cluster", "up", "--name", "dbdelay", "--nodes", "2", "--delay", "1ms"]) == 2
    err = capsys.readouterr().err
    assert "error: --delay:" in err and "netem" in err and "--delay 0" in err, err
    assert nc.leftovers("dbdelay") == []


def _up_until_head_started(name: str, subnet: str) -> tuple[subprocess.Popen, int]:
    """`cluster up` in the background, until its state file names the head's `ray start` (mid-way: the network
    is made and Ray is starting)."""
    p = subprocess.Popen(PY + ["cluster", "up", "--name", name, "--subnet", subnet, "--nodes", "2"], env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def head_started() -> bool:
        c = nc.load(name) if nc.state_path(name).exists() else None
        return bool(c and c.up_pid == p.pid and c.nodes[0].pid) or p.poll() is not None

    assert nc._wait_until(head_started, 60), "cluster up never started the head"
    assert p.poll() is None, p.communicate()[1][-2000:]
    return p, nc.load(name).nodes[0].pid


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(240)
def test_a_killed_up_is_cleaned_by_the_next_up_or_by_down_and_an_interrupted_up_cleans_itself():
    """(c): `up` killed with SIGKILL half-way leaves namespaces, links and Ray processes. The next `up` removes
    them first; that one, interrupted with Ctrl-C half-way, removes what it made itself and exits with 130. A
    second killed `up` is cleaned up by `down`."""
    name, subnet = "dbcrash", "10.79.0"
    try:
        killed, head = _up_until_head_started(name, subnet)
        killed.kill()
        killed.wait(30)
        left = nc.leftovers(name)
        assert any(x.startswith("namespace") for x in left) and f"interface {name}-br" in left

        p, head2 = _up_until_head_started(name, subnet)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 130, err[-2000:]
        assert f"cleaning up what an earlier run of cluster {name} left" in err and "removing what was made" in err
        _assert_gone(name, [head, head2])

        killed, head = _up_until_head_started(name, subnet)
        killed.kill()
        killed.wait(30)
        assert nc.leftovers(name)
        down = subprocess.run(PY + ["cluster", "down", "--name", name], capture_output=True, text=True,
                              timeout=120, check=False)
        assert down.returncode == 0, down.stderr
        _assert_gone(name, [head])
    finally:
        nc.down(name, log=lambda msg: None)
