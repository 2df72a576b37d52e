"""Settings of the Ray instances distbelief starts, in a module that does not import Ray.

``SYSTEM_CONFIG`` is what a local instance gets (``ray.init(_system_config=...)``) and what the head of a cluster
that ``distbelief cluster up`` makes gets (``ray start --head --system-config=...``); docs/cluster.md asks the same
of a cluster a user starts. The simulator reads ``INLINE_BYTES`` from here: what it predicts assumes the run's
Ray sends arguments and replies up to that size inline.
"""

from __future__ import annotations

import json

SYSTEM_CONFIG = {
    # Call arguments and replies up to 512 KiB travel inline with the call instead of through the object store:
    # on one node ~1.3 ms vs ~2.2 ms per round trip for 160 KB here. Between nodes it keeps compressed parts
    # of ~100 KB (PowerSGD's, top-k's for Fig. 4's shards) off the object store: over Ray's default 100 KiB,
    # a 108 KB PowerSGD part went through it and, now and then, waited a second to arrive; Downpour with
    # PowerSGD + fp16 over 1 Gbit/s links made 831-1,053 examples/s with the default, 1,071-1,267 with this
    # (9 runs each, alternated; benchmarks/RESULTS.md).
    "max_direct_call_object_size": 512 * 1024,
    # No Ray metrics (nothing reads them; no dashboard is started): their exporter thread runs in every worker,
    # and in Ray 2.60 it crashed a shard's worker with SIGSEGV during our test suite.
    "enable_metrics_collection": False,
}

# Arguments and replies up to this many bytes travel inline with a call, not through the object store.
INLINE_BYTES: int = SYSTEM_CONFIG["max_direct_call_object_size"]


def system_config_flag() -> str:
    """``ray start --head``'s flag that gives a cluster ``SYSTEM_CONFIG`` (its other nodes take it from the
    head)."""
    return "--system-config=" + json.dumps(SYSTEM_CONFIG, separators=(",", ":"))
