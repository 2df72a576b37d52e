"""A shaped Ray cluster on one Linux machine: N Ray nodes, each in its own network namespace, joined by a bridge,
every link shaped with ``tc`` (``distbelief cluster up | down | status``).

Why: ``ray.cluster_utils.Cluster`` puts every "node" on one loopback device with no bandwidth limit, so the data
plane between nodes (what n_fetch / n_push and compression are about) never meets a real link. Here it does: a
transfer between two nodes leaves one namespace through its veth, crosses the bridge and enters the other's, at
the shaped rate and delay, and the kernel's counters on each veth say what crossed (:func:`link_counters`).

Layout of a cluster named ``dbnet`` on subnet ``10.77.0``::

    root namespace: bridge dbnet-br, 10.77.0.1/24
        dbnet-v0 <=veth=> eth0 in namespace dbnet-n0, 10.77.0.10   the Ray head (GCS on :6379)
        dbnet-v1 <=veth=> eth0 in namespace dbnet-n1, 10.77.0.11   a Ray node joined to it
        ...

Shaping, per node: what leaves the node (``eth0`` in its namespace) goes through ``tbf`` at the rate with
``netem`` (the delay) inside it; what enters it (the root-side veth's egress, towards the node) through ``tbf`` at
the rate. So each direction of each link carries at most the rate, and the one-way latency between two nodes is
the delay (the round trip twice it). Traffic stays on private addresses inside namespaces made here.

A job joins with ``--address HEAD:6379`` exactly as on a real cluster, from a process on a node, as Ray requires
of a driver (it attaches to a raylet of its own host): ``ip netns exec dbnet-n0 distbelief train --address
10.77.0.10:6379``. Every node's ``ray start`` runs with ``RAY_AUTH_MODE=token``: the head then turns token
authentication on (without it, it does so only where the machine already has a token), and Ray 2.60's
``ray start --address`` only sends the token when that variable is set. A machine with no token yet (none in
``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``: no local Ray has run here) gets one first, from Ray's own ``ray
get-auth-token --generate``; the head with the mode set and no token refuses to start.

State (namespaces, links, the pid of every ``ray start --block``) is written to ``STATE_DIR`` before anything is
made, so ``down`` (or the next ``up``) removes what a crashed or killed ``up`` left; ``up`` itself removes what it
made when it fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distbelief.exceptions import ConfigError, DistBeliefError
from distbelief.runtime.ray_notice import token_path, token_present
from distbelief.runtime.ray_settings import system_config_flag

STATE_DIR = Path("/run/distbelief")
DEFAULT_NAME = "dbnet"
DEFAULT_SUBNET = "10.77.0"
HEAD_PORT = 6379
FIRST_HOST = 10  # node i is SUBNET.(10 + i); .1 is the bridge in the root namespace
MAX_NODES = 200
SHARD_RESOURCE = "distbelief_shard"  # ray_runtime.SHARD_NODE_RESOURCE (not imported: that module imports ray)
# Header bytes of one TCP/IPv4 frame as a veth counts it: Ethernet 14 + IPv4 20 + TCP with timestamps 32. A
# segmentation-offload (GSO) packet is counted once with one set of headers, so bytes - packets x this is the
# TCP payload however the kernel batched it (see payload_bytes).
FRAME_HEADER_BYTES = 66

_NAME_RE = re.compile(r"[a-z][a-z0-9]{0,7}\Z")  # interface names: NAME-v199 must fit in 15 characters
_SUBNET_RE = re.compile(r"(10|172|192)\.(\d{1,3})\.(\d{1,3})\Z")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class NetClusterError(DistBeliefError):
    """The shaped cluster could not be brought up or down: the message says what failed and what to run next."""


# ---------------------------------------------------------------------------------------------------- settings


def parse_rate(text: str) -> int:
    """Bits per second from tc's words (``1gbit``, ``100mbit``, ``500kbit``). Bytes-per-second units (tc's
    ``bps``) are refused: they are a factor 8 away from what people mean by "1 gig"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?bit)?\s*", str(text).lower())
    if m and float(m[1]) == 0:
        raise ConfigError("bandwidth", f"must be more than 0, got {text!r} (e.g. 1gbit)")
    if not m or m[2] is None:
        raise ConfigError("bandwidth", f"{text!r} is not a rate in bits per second like 1gbit, 100mbit or 500kbit")
    bps = float(m[1]) * _RATE_UNITS[m[2]]
    if not 64_000 <= bps <= 100 * 10**9:
        raise ConfigError("bandwidth", f"must be between 64kbit and 100gbit, got {text}")
    return int(bps)


def parse_delay(text: str) -> float:
    """Seconds from ``1ms``, ``500us``, ``0.2s`` or ``0`` (no delay)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s)?\s*", str(text).lower())
    if not m or (m[2] is None and float(m[1]) != 0):
        raise ConfigError("delay", f"{text!r} is not a one-way delay like 1ms, 500us or 0")
    seconds = float(m[1]) * _DELAY_UNITS[m[2] or "s"]
    if seconds > 10:
        raise ConfigError("delay", f"must be at most 10s, got {text}")
    return seconds


def check_name(name: str) -> str:
    if not _NAME_RE.match(str(name)):
        raise ConfigError("name", f"{name!r}: use 1-8 lowercase letters or digits, starting with a letter (it "
                                  f"prefixes interface names, which Linux limits to 15 characters)")
    return name


def _check_subnet(subnet: str) -> str:
    m = _SUBNET_RE.match(subnet)
    private = m and all(int(x) < 256 for x in m.groups()[1:]) and (
        m[1] == "10" or (m[1] == "172" and 16 <= int(m[2]) <= 31) or (m[1] == "192" and m[2] == "168"))
    if not private:
        raise ConfigError("subnet", f"{subnet!r}: give the first three numbers of a private /24, e.g. 10.77.0")
    return subnet


# ------------------------------------------------------------------------------------------------------ model


@dataclass
class Node:
    index: int
    netns: str  # its network namespace
    link: str  # the root-side end of its veth (on the bridge); the other end is eth0 in the namespace
    ip: str
    cpus: int
    resources: dict = field(default_factory=dict)
    pid: int | None = None  # the `ray start --block` process
    log: str = ""  # that process's output


@dataclass
class Cluster:
    name: str
    subnet: str
    bandwidth_bps: int
    delay_s: float
    object_store_mb: int
    nodes: list[Node]
    up_pid: int = 0  # the process that ran `up`
    complete: bool = False  # every node joined

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    @property
    def bridge_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def address(self) -> str:
        """What to pass to ``distbelief train --address``."""
        return f"{self.nodes[0].ip}:{HEAD_PORT}"

    @property
    def temp_dir(self) -> str:
        """Where this cluster's nodes keep their Ray files, each in a folder of its own (not /tmp/ray: other Ray
        instances on this machine keep their ``session_latest``); removed by ``down``."""
        return temp_dir_of(self.name)

    def driver_prefix(self) -> str:
        """How to run a driver on the head node (a Ray driver must run on a node of its cluster)."""
        return f"ip netns exec {self.nodes[0].netns}"

    @staticmethod
    def from_json(data: dict) -> Cluster:
        nodes = [Node(**n) for n in data.pop("nodes")]
        return Cluster(nodes=nodes, **data)


def temp_dir_of(name: str) -> str:
    return f"/tmp/distbelief-net-{name}"


def plan(name: str = DEFAULT_NAME, nodes: int = 2, bandwidth: str = "1gbit", delay: str = "0",
         cpus_per_node: int = 1, shard_nodes: int = 0, subnet: str = DEFAULT_SUBNET, object_store_mb: int = 512,
         node_cpus: list[int] | None = None, node_resources: list[dict] | None = None) -> Cluster:
    """The cluster ``up`` would make, every setting checked (ConfigError naming it) before anything exists.

    ``shard_nodes``: the last K nodes are dedicated shard nodes (the ``distbelief_shard`` resource, no CPUs), so
    shards and replicas land on different nodes and every push and fetch crosses a link. ``node_cpus`` /
    ``node_resources`` (one entry per node) override the CPUs and add Ray resources per node."""
    check_name(name)
    _check_subnet(subnet)
    if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
        raise ConfigError("nodes", f"must be an integer in [1, {MAX_NODES}], got {nodes}")
    if not isinstance(cpus_per_node, int) or cpus_per_node < 0:
        raise ConfigError("cpus_per_node", f"must be an integer >= 0, got {cpus_per_node}")
    if not isinstance(shard_nodes, int) or not 0 <= shard_nodes < nodes:
        raise ConfigError("shard_nodes", f"must be in [0, nodes - 1] = [0, {nodes - 1}] (the head stays a general "
                                         f"node), got {shard_nodes}")
    if not isinstance(object_store_mb, int) or object_store_mb < 80:
        raise ConfigError("object_store_mb", f"must be an integer >= 80 (Ray's minimum), got {object_store_mb}")
    for what, given in (("node_cpus", node_cpus), ("node_resources", node_resources)):
        if given is not None and len(given) != nodes:
            raise ConfigError(what, f"needs one entry per node ({nodes}), got {len(given)}")
    rate, delay_s = parse_rate(bandwidth), parse_delay(delay)
    out = []
    for i in range(nodes):
        shard = i >= nodes - shard_nodes
        cpus = node_cpus[i] if node_cpus is not None else (0 if shard else cpus_per_node)
        resources = {SHARD_RESOURCE: 1} if shard else {}
        resources.update((node_resources or [{}] * nodes)[i])
        out.append(Node(i, f"{name}-n{i}", f"{name}-v{i}", f"{subnet}.{FIRST_HOST + i}", cpus, resources))
    return Cluster(name, subnet, rate, delay_s, object_store_mb, out)


# ------------------------------------------------------------------------------------------------ system calls


def require_root_linux() -> None:
    """Refuse where namespaces, veths and tc cannot be made, saying why."""
    if not sys.platform.startswith("linux"):
        raise NetClusterError(f"the shaped cluster needs Linux (network namespaces, veth pairs, tc); this is "
                              f"{sys.platform}")
    if os.geteuid() != 0:
        raise NetClusterError("the shaped cluster needs root: it creates network namespaces, a bridge, veth pairs "
                              "and tc qdiscs (run it with sudo, or as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetClusterError(f"`{tool}` not found: the shaped cluster needs iproute2 (apt-get install "
                                  f"iproute2)")
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=False)
    if r.returncode != 0:
        raise NetClusterError(f"`ip netns` does not work here: {r.stderr.strip()}")


def _run(cmd: list[str], timeout_s: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (never a shell); a failure names the command and says what it printed."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise NetClusterError(f"`{' '.join(cmd)}` did not finish within {timeout_s:.0f}s") from None
    if check and r.returncode != 0:
        raise NetClusterError(f"`{' '.join(cmd)}` failed (status {r.returncode}): {r.stderr.strip()}")
    return r


def _namespaces(name: str) -> list[str]:
    """This cluster's namespaces that exist now (from `ip netns list`)."""
    r = _run(["ip", "netns", "list"], check=False)
    pattern = re.compile(rf"{re.escape(name)}-n\d+\Z")
    return [line.split()[0] for line in r.stdout.splitlines() if line.split() and pattern.match(line.split()[0])]


def _links(name: str) -> list[str]:
    """This cluster's interfaces in the root namespace (its bridge and the root-side veth ends)."""
    pattern = re.compile(rf"{re.escape(name)}-(v\d+|br)\Z")
    return sorted(n for n in os.listdir("/sys/class/net") if pattern.match(n))


def _netns_pids(netns: str) -> list[int]:
    r = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie is dead: it is reaped here when it is our child)."""
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _pids_with(path: str) -> list[int]:
    """Processes whose command line names ``path`` or a file under it (this cluster's Ray temp dir: every Ray
    process of the cluster has it there), in case one escaped its namespace's cleanup."""
    pattern = re.compile(re.escape(path.encode()) + rb"(/|\x00|$)")
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if pattern.search(Path(f"/proc/{d}/cmdline").read_bytes()) and _alive(int(d)):
                out.append(int(d))
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_until(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> bool:
    """Poll ``done`` until it holds or ``timeout_s`` passes; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


# ----------------------------------------------------------------------------------------------------- state


def state_path(name: str) -> Path:
    return STATE_DIR / f"netcluster-{name}.json"


def _save(c: Cluster) -> None:
    """Atomically: a reader (or a crash) never sees half a file."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = state_path(c.name).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(c), indent=1))
    os.replace(tmp, state_path(c.name))


def load(name: str = DEFAULT_NAME) -> Cluster | None:
    """The state ``up`` wrote for cluster ``name``, or None."""
    try:
        return Cluster.from_json(json.loads(state_path(name).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as e:
        raise NetClusterError(f"{state_path(name)} is unreadable ({e}); remove it and run `distbelief cluster "
                              f"down --name {name}` to clean up by name") from None


@contextlib.contextmanager
def _locked(name: str, timeout_s: float) -> Iterator[None]:
    """One `up` or `down` at a time on this machine, whatever the cluster (the subnet check of one `up` must not
    race another's); one lock file for all, kept, and the kernel drops the lock of a process that dies."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "netcluster.lock", "w") as f:
        def take() -> bool:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

        if not _wait_until(take, timeout_s):
            raise NetClusterError(f"another `distbelief cluster up` or `down` kept running for {timeout_s:.0f}s "
                                  f"(lock {f.name}); try `distbelief cluster down --name {name}` again later")
        yield


# ------------------------------------------------------------------------------------------------------- up


def _make_network(c: Cluster) -> None:
    """The bridge, then for every node its namespace, veth pair, address and shaping."""
    _run(["ip", "link", "add", "name", c.bridge, "type", "bridge"])
    _no_ipv6(None, c.bridge)
    _run(["ip", "addr", "add", f"{c.bridge_ip}/24", "dev", c.bridge])
    _run(["ip", "link", "set", c.bridge, "up"])
    for n in c.nodes:
        _run(["ip", "netns", "add", n.netns])
        _run(["ip", "link", "add", n.link, "type", "veth", "peer", "name", "eth0", "netns", n.netns])
        _no_ipv6(None, n.link)
        _no_ipv6(n.netns, "all")
        _run(["ip", "-n", n.netns, "addr", "add", f"{n.ip}/24", "dev", "eth0"])
        _run(["ip", "-n", n.netns, "link", "set", "lo", "up"])
        _run(["ip", "-n", n.netns, "link", "set", "eth0", "up"])
        _run(["ip", "link", "set", n.link, "master", c.bridge])
        _run(["ip", "link", "set", n.link, "up"])
        _shape(c, n)


def _no_ipv6(netns: str | None, dev: str) -> None:
    """No IPv6 on the cluster's links: its router solicitations and multicast reports would add traffic of their
    own to the links' counters. Best effort (a kernel without IPv6 has nothing to turn off)."""
    key = f"net/ipv6/conf/{dev}/disable_ipv6"
    if netns is None:
        with contextlib.suppress(OSError):
            Path(f"/proc/sys/{key}").write_text("1")
        return
    _run(["ip", "netns", "exec", netns, "sh", "-c", f"echo 1 > /proc/sys/{key}"], check=False)


def _burst_bytes(rate_bps: int) -> int:
    """tbf's bucket: 2 ms of the rate, and never less than one 64 KiB segmentation-offload packet (a smaller
    bucket makes tbf split or drop those)."""
    return max(64 * 1024 + 1514, rate_bps // 8 // 500)


def _tbf(rate_bps: int) -> list[str]:
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(_burst_bytes(rate_bps)), "latency", "50ms"]


def _netem(delay_s: float) -> list[str]:
    return ["netem", "delay", f"{round(delay_s * 1e6)}us", "limit", "10000"]


def _shape(c: Cluster, n: Node) -> None:
    """Both directions of node ``n``'s link at the rate; its egress also delayed by the delay (when not 0)."""
    tbf = _tbf(c.bandwidth_bps)
    _run(["tc", "-n", n.netns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:"] + tbf)
    if c.delay_s > 0:
        _run(["tc", "-n", n.netns, "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "10:"]
             + _netem(c.delay_s))
    _run(["tc", "qdisc", "add", "dev", n.link, "root", "handle", "1:"] + tbf)


def check_qdiscs(c: Cluster) -> None:
    """Before anything is made: this kernel has the qdiscs the shaping needs (tbf; netem for a delay). Tried in a
    throwaway network namespace of one `tc` process (`unshare --net`), which vanishes with it. A kernel without
    netem (some VM kernels) can still limit rates: --delay 0."""
    wanted = [("tbf", _tbf(c.bandwidth_bps), "bandwidth")]
    if c.delay_s > 0:
        wanted.append(("netem", _netem(c.delay_s), "delay"))
    if shutil.which("unshare") is None:
        return  # no way to try without making something: `up` fails at the first qdisc and cleans up instead
    for kind, args, flag in wanted:
        r = _run(["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root"] + args, check=False)
        if r.returncode != 0:
            hint = (" use --delay 0 (the rate is still shaped with tbf), or a kernel with sch_netem"
                    if kind == "netem" else " use a kernel with sch_tbf")
            raise ConfigError(flag, f"this kernel cannot shape links with {kind} (`tc qdisc add ... {kind}`: "
                                    f"{r.stderr.strip()});{hint}")


def _ray_exe() -> str:
    ray = Path(sys.executable).with_name("ray")
    if ray.is_file():
        return str(ray)
    found = shutil.which("ray")
    if found is None:
        raise NetClusterError("the `ray` command is not installed next to this Python nor on PATH")
    return found


def _ray_start_command(c: Cluster, n: Node) -> list[str]:
    """The command a real cluster's node runs, plus what one machine needs: the node's address (its namespace's),
    a bounded object store (every node's store is in this machine's /dev/shm), --block, and a temp dir of its
    own (nodes started at once in one temp dir raced for the same socket names: one timed out at startup)."""
    cmd = [_ray_exe(), "start", f"--node-ip-address={n.ip}", f"--num-cpus={n.cpus}",
           f"--resources={json.dumps(n.resources)}", f"--object-store-memory={c.object_store_mb * 2**20}",
           f"--temp-dir={c.temp_dir}/n{n.index}", "--disable-usage-stats", "--block"]
    if n.index == 0:
        # the local instance's settings, as docs/cluster.md advises for a cluster distbelief joins (the other
        # nodes take them from the head)
        return cmd[:2] + ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false",
                          system_config_flag()] + cmd[2:]
    return cmd[:2] + [f"--address={c.address}"] + cmd[2:]


def _ray_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    # the head: authentication on whether or not a token was here before (``_ensure_token`` made sure of one);
    # a joining node (Ray 2.60): `ray start --address` sends the token only with this set
    env["RAY_AUTH_MODE"] = "token"
    return env


def _ensure_token(log: Log) -> None:
    """A token for the cluster: the one this machine has, else a new one from Ray's own command (a fresh machine
    where no local Ray has run has none, and a head started with ``RAY_AUTH_MODE=token`` refuses to start)."""
    if token_present():
        return
    r = subprocess.run([_ray_exe(), "get-auth-token", "--generate"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    if r.returncode != 0 or not token_present():
        raise NetClusterError(f"no Ray token on this machine and `ray get-auth-token --generate` could not make one "
                              f"(status {r.returncode}): {r.stderr.strip()[-500:]}")
    log(f"no Ray token on this machine: made one at {token_path()} (`ray get-auth-token --generate`); the "
        f"cluster's nodes and its jobs use it")


def _start_node(c: Cluster, n: Node, procs: dict) -> None:
    n.log = str(STATE_DIR / f"netcluster-{c.name}-n{n.index}.log")
    with open(n.log, "w") as out:
        p = subprocess.Popen(["ip", "netns", "exec", n.netns] + _ray_start_command(c, n), env=_ray_env(),
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)  # a Ctrl-C at the terminal reaches `up`, which cleans up
    n.pid = p.pid
    procs[n.index] = p
    _save(c)


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _check_running(c: Cluster, procs: dict) -> None:
    for i, p in procs.items():
        if p.poll() is not None:
            n = c.nodes[i]
            raise NetClusterError(f"`ray start` of node {i} ({n.netns}, {n.ip}) exited with status {p.returncode}:"
                                  f"\n{_tail(n.log)}")


def _port_open(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1):
            return True
    except OSError:
        return False


_COUNT_NODES = """
import sys, time
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
address, want, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
client, alive = GcsClient(address=address), -1
while time.monotonic() < deadline:
    try:
        alive = len(client.get_all_node_info(timeout=5, state_filter=GcsNodeInfo.GcsNodeState.ALIVE))
    except Exception:
        alive = -1
    if alive >= want:
        break
    time.sleep(0.5)
print(alive)
"""


def _wait_joined(c: Cluster, procs: dict, timeout_s: float) -> None:
    """Until the head's GCS counts every node alive (asked in a child process: the token mode it needs must not
    leak into this process's Ray settings), watching that no `ray start` died meanwhile."""
    env = dict(os.environ, RAY_AUTH_MODE="token")
    counter = subprocess.Popen([sys.executable, "-c", _COUNT_NODES, c.address, str(len(c.nodes)), str(timeout_s)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def counted() -> bool:
        _check_running(c, procs)
        return counter.poll() is not None

    try:
        finished = _wait_until(counted, timeout_s + 30)
        if not finished:
            raise NetClusterError(f"the GCS at {c.address} did not answer within {timeout_s + 30:.0f}s")
        out, err = counter.communicate(timeout=10)
    finally:
        if counter.poll() is None:
            counter.kill()
            counter.wait(10)
    alive = int(out.strip() or -1) if out.strip().lstrip("-").isdigit() else -1
    if alive < len(c.nodes):
        logs = "\n".join(f"--- node {n.index} ({n.log}):\n{_tail(n.log, 6)}" for n in c.nodes)
        raise NetClusterError(f"only {max(alive, 0)} of {len(c.nodes)} nodes joined the cluster at {c.address} "
                              f"within {timeout_s:.0f}s{': ' + err.strip()[-500:] if err.strip() else ''}\n{logs}")


def _start_ray(c: Cluster, timeout_s: float, log: Log) -> None:
    """The head, then (once its GCS listens) every other node, all at once; then wait until all joined."""
    procs: dict = {}
    deadline = time.monotonic() + timeout_s
    _ensure_token(log)
    _start_node(c, c.nodes[0], procs)
    head = c.nodes[0]

    def listening() -> bool:
        _check_running(c, procs)
        return _port_open(head.ip, HEAD_PORT)

    if not _wait_until(listening, max(1.0, deadline - time.monotonic()), poll_s=0.5):
        raise NetClusterError(f"the head's GCS did not listen on {c.address} within {timeout_s:.0f}s:\n"
                              f"{_tail(head.log)}")
    log(f"head up at {c.address}; starting {len(c.nodes) - 1} more node(s)")
    for n in c.nodes[1:]:
        _start_node(c, n, procs)
    _wait_joined(c, procs, max(1.0, deadline - time.monotonic()))


def _running_cluster(name: str) -> Cluster | None:
    """The state of cluster ``name`` if it is up and whole (every `ray start` alive), else None."""
    c = load(name)
    if c and c.complete and all(n.pid and _alive(n.pid) for n in c.nodes) and set(_namespaces(name)) == {
            n.netns for n in c.nodes}:
        return c
    return None


def leftovers(name: str) -> list[str]:
    """What of cluster ``name`` exists now: namespaces, interfaces, processes, state file."""
    found = [f"namespace {ns}" for ns in _namespaces(name)] + [f"interface {link}" for link in _links(name)]
    found += [f"process {pid}" for pid in _pids_with(temp_dir_of(name))]
    if state_path(name).exists():
        found.append(f"state file {state_path(name)}")
    return found


def up(name: str = DEFAULT_NAME, nodes: int = 2, bandwidth: str = "1gbit", delay: str = "0",
       cpus_per_node: int = 1, shard_nodes: int = 0, subnet: str = DEFAULT_SUBNET, object_store_mb: int = 512,
       node_cpus: list[int] | None = None, node_resources: list[dict] | None = None, timeout_s: float = 180.0,
       log: Log = _stderr) -> Cluster:
    """Bring up a shaped cluster (see the module's docstring) and return it; ``.address`` is what a job joins.

    Settings are checked first (ConfigError naming the setting, nothing made). What a crashed earlier `up` or
    `down` of the same name left is removed first; a cluster of that name that is up is refused. If anything
    fails or the process is interrupted (Ctrl-C, SIGTERM turned into KeyboardInterrupt), everything made so far
    is removed before the error goes on."""
    c = plan(name, nodes, bandwidth, delay, cpus_per_node, shard_nodes, subnet, object_store_mb, node_cpus,
             node_resources)
    require_root_linux()
    _ray_exe()
    with _locked(name, timeout_s=timeout_s):
        running = _running_cluster(name)
        if running:
            raise NetClusterError(f"cluster {name} is already up at {running.address}; `distbelief cluster down "
                                  f"--name {name}` first")
        left = leftovers(name)
        if left:
            log(f"cleaning up what an earlier run of cluster {name} left: {', '.join(left)}")
            _teardown(name, log)
        _check_subnet_free(c)
        check_qdiscs(c)
        c.up_pid = os.getpid()
        try:
            _save(c)  # first: from here on a crash leaves a state file naming what to remove
            _make_network(c)
            log(f"network up: {len(c.nodes)} namespaces on {c.bridge} ({c.subnet}.0/24), every link "
                f"{describe_rate(c.bandwidth_bps)}, {describe_delay(c.delay_s)}")
            _start_ray(c, timeout_s, log)
            c.complete = True
            _save(c)
        except BaseException as e:
            with _no_interrupts():
                log(f"cluster {name} not up ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                    f"removing what was made")
                _teardown(name, log)
            raise
    return c


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """A second Ctrl-C must not cut the cleanup of the first short (main thread only: signals live there)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _check_subnet_free(c: Cluster) -> None:
    r = _run(["ip", "-o", "-4", "addr", "show"], check=False)
    used = re.findall(rf"inet ({re.escape(c.subnet)}\.\d+)/(\d+)", r.stdout)
    if used:
        raise NetClusterError(f"the subnet {c.subnet}.0/24 is in use on this machine ({used[0][0]}); pick another "
                              f"with --subnet")


def describe_delay(seconds: float) -> str:
    return f"{seconds * 1e3:g} ms one way" if seconds > 0 else "no added delay"


def describe_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


# ----------------------------------------------------------------------------------------------------- down


def down(name: str = DEFAULT_NAME, log: Log = _stderr, timeout_s: float = 60.0) -> list[str]:
    """Stop every Ray process of cluster ``name`` and remove its namespaces, links, bridge and state file.
    Idempotent (nothing there: nothing done) and works from whatever a crash left, with or without a state file.
    Returns what it removed."""
    check_name(name)
    require_root_linux()
    with _locked(name, timeout_s=timeout_s):
        return _teardown(name, log)


def _teardown(name: str, log: Log) -> list[str]:
    """``down`` under the lock: processes first (gracefully, then not), then namespaces, links, files."""
    state = load(name)
    namespaces = sorted(set(_namespaces(name)) | ({n.netns for n in state.nodes} if state else set()))
    present = set(_namespaces(name))
    removed: list[str] = []
    # `ray start --block` stops what it started on SIGTERM; only signal one still in its namespace (not a reused
    # pid that now belongs to something else)
    starters = [n.pid for n in (state.nodes if state else []) if n.pid and n.netns in present
                and n.pid in _netns_pids(n.netns)]
    _signal(starters, signal.SIGTERM)
    _wait_until(lambda: not any(_alive(p) for p in starters), 20)
    for ns in (ns for ns in namespaces if ns in present):
        stopped = _empty_namespace(ns)
        removed += [f"process {pid}" for pid in stopped]
    strays = _pids_with(temp_dir_of(name))  # e.g. left in a namespace that a crashed `down` deleted
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _signal(strays, sig)
        if _wait_until(lambda: not any(_alive(p) for p in strays), 5):
            break
    removed += [f"process {pid}" for pid in strays]
    for ns in _namespaces(name):
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(f"namespace {ns}")
    for link in _links(name):  # a namespace's veth pair goes with it; what is left is the bridge (or a half-made pair)
        _run(["ip", "link", "del", link], check=False)
        removed.append(f"interface {link}")
    shutil.rmtree(temp_dir_of(name), ignore_errors=True)
    for f in STATE_DIR.glob(f"netcluster-{name}-n*.log"):
        f.unlink(missing_ok=True)
    if state_path(name).exists():
        state_path(name).unlink()
        removed.append(f"state file {state_path(name)}")
    left = [x for x in leftovers(name) if not x.startswith("state file")]
    if left:
        raise NetClusterError(f"could not remove all of cluster {name}: {', '.join(left)} remain")
    if removed:
        log(f"cluster {name} down: removed {len(_count(removed, 'namespace'))} namespace(s), "
            f"{len(_count(removed, 'interface'))} interface(s), {len(_count(removed, 'process'))} process(es)")
    return removed


def _count(items: list[str], kind: str) -> list[str]:
    return [x for x in items if x.startswith(kind + " ")]


def _empty_namespace(ns: str) -> list[int]:
    """Stop whatever still runs in namespace ``ns`` (Ray workers, a driver started with `ip netns exec`): SIGTERM,
    then SIGKILL. Returns the pids that were there."""
    seen = _netns_pids(ns)
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        pids = _netns_pids(ns)
        if not pids:
            break
        _signal(pids, sig)
        _wait_until(lambda: not _netns_pids(ns), grace)
    return seen


# --------------------------------------------------------------------------------------------------- status


@dataclass
class LinkCounters:
    """What crossed one node's link, from the kernel's counters on its root-side veth (the bridge's port)."""
    to_node_bytes: int
    from_node_bytes: int
    to_node_packets: int
    from_node_packets: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))

    @property
    def to_node_payload(self) -> int:
        return payload_bytes(self.to_node_bytes, self.to_node_packets)

    @property
    def from_node_payload(self) -> int:
        return payload_bytes(self.from_node_bytes, self.from_node_packets)


def payload_bytes(frame_bytes: int, packets: int) -> int:
    """TCP payload in ``frame_bytes`` carried by ``packets`` TCP/IPv4 frames (FRAME_HEADER_BYTES each)."""
    return frame_bytes - FRAME_HEADER_BYTES * packets


def link_counters(name: str = DEFAULT_NAME) -> dict[int, LinkCounters]:
    """Per node index, the bytes and packets its link carried so far each way (the root-side veth's ``tx`` is
    towards the node, its ``rx`` from it). Subtract two readings to measure a run."""
    c = load(name)
    if c is None:
        raise NetClusterError(f"no cluster {name} (no {state_path(name)}); `distbelief cluster up` first")
    out = {}
    for n in c.nodes:
        stats = Path(f"/sys/class/net/{n.link}/statistics")
        try:
            read = {k: int((stats / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}
        except OSError:
            raise NetClusterError(f"node {n.index}'s link {n.link} is gone; is cluster {name} up?") from None
        out[n.index] = LinkCounters(read["tx_bytes"], read["rx_bytes"], read["tx_packets"], read["rx_packets"])
    return out


def _cluster_names() -> set[str]:
    """Names with a state file, or with namespaces named like a cluster's (what a crash may leave)."""
    names = {p.name[len("netcluster-"):-len(".json")] for p in STATE_DIR.glob("netcluster-*.json")}
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    names |= {m[1] for line in listed if (m := re.match(r"([a-z][a-z0-9]{0,7})-n\d+(\s|$)", line))}
    return names


def status(name: str | None = None) -> list[dict]:
    """Every cluster with a state file (or only ``name``), its address, nodes (pid alive or not) and link bytes;
    plus, under the name, namespaces left without a state file."""
    names = [name] if name else sorted(_cluster_names())
    out = []
    for nm in names:
        c = load(nm)
        if c is None:
            left = leftovers(nm)
            if left:
                out.append({"name": nm, "up": False, "leftovers": left})
            continue
        counters = {}
        with contextlib.suppress(NetClusterError):
            counters = link_counters(nm)
        nodes = [{"index": n.index, "netns": n.netns, "ip": n.ip, "cpus": n.cpus, "resources": n.resources,
                  "pid": n.pid, "alive": bool(n.pid and _alive(n.pid)),
                  **(asdict(counters[n.index]) if n.index in counters else {})} for n in c.nodes]
        out.append({"name": nm, "up": _running_cluster(nm) is not None, "address": c.address,
                    "driver_prefix": c.driver_prefix(), "bandwidth": describe_rate(c.bandwidth_bps),
                    "delay_ms": c.delay_s * 1e3, "delay": describe_delay(c.delay_s), "nodes": nodes})
    return out


# ---------------------------------------------------------------------------------------------------- probes


_TCP_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(float(sys.argv[3]))
conn, _ = s.accept(); conn.settimeout(float(sys.argv[3]))
buf, got, first = bytearray(1 << 20), 0, None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    first = first or time.monotonic()
    got += n
print(got, time.monotonic() - first)
"""

_TCP_SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
chunk, left = b"x" * (1 << 20), int(sys.argv[3])
while left > 0:
    left -= s.send(chunk[:left])
s.close()
"""


def measure_tcp(name: str = DEFAULT_NAME, src: int = 1, dst: int = 0, megabytes: int = 200,
                timeout_s: float = 120.0, port: int = 5299) -> dict:
    """Raw TCP from node ``src`` to node ``dst`` (one connection, plain Python sockets): the rate the link gives
    a single stream, to compare what Ray and distbelief get against. Returns bytes, seconds, Gbit/s and the
    share of the shaped rate."""
    c = load(name)
    if c is None or not 0 <= src < len(c.nodes) or not 0 <= dst < len(c.nodes) or src == dst:
        raise NetClusterError(f"cluster {name} is not up or has no nodes {src} and {dst}")
    a, b = c.nodes[src], c.nodes[dst]
    recv = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-c", _TCP_RECEIVER, b.ip, str(port),
                             str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if not _wait_until(lambda: recv.poll() is not None or _port_listening(b.netns, port), 15):
            raise NetClusterError(f"the receiver in {b.netns} did not listen within 15s")
        _run(["ip", "netns", "exec", a.netns, sys.executable, "-c", _TCP_SENDER, b.ip, str(port),
              str(megabytes * 10**6), str(timeout_s)], timeout_s=timeout_s)
        out, err = recv.communicate(timeout=timeout_s)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(10)
    if recv.returncode != 0:
        raise NetClusterError(f"the TCP receiver failed: {err.strip()[-500:]}")
    got, seconds = out.split()
    gbit = int(got) * 8 / float(seconds) / 1e9
    return {"bytes": int(got), "seconds": float(seconds), "gbit_per_s": gbit,
            "utilization": gbit * 1e9 / c.bandwidth_bps}


def _port_listening(netns: str, port: int) -> bool:
    r = _run(["ip", "netns", "exec", netns, "cat", "/proc/net/tcp"], check=False)
    return any(line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"
               for line in r.stdout.splitlines()[1:] if len(line.split()) > 3)
