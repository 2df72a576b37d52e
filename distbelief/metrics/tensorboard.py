"""TensorBoard logging: a metrics record's scalars (plain values and rates against the previous record), written
to ``RUN_DIR/tensorboard/``. TensorBoard itself is imported only when a run asks for it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"

# metrics-record key -> TensorBoard tag, for the values written as they are (cumulative or instantaneous).
_PLAIN_SCALARS = {
    "train_loss": "train/loss",
    "test_accuracy": "test/accuracy",
    "test_loss": "test/loss",
    "examples_per_s": "throughput/examples_per_s",
    "staleness_mean": "staleness/mean",
    "staleness_max": "staleness/max",
    "bytes_pushed": "bytes/pushed",
    "bytes_fetched": "bytes/fetched",
    "rejected_pushes": "server/rejected_pushes",
    "replicas_alive": "server/replicas_alive",
}
# cumulative counter -> tag of its rate between consecutive records
_RATE_SCALARS = {"bytes_pushed": "bytes/pushed_per_s", "bytes_fetched": "bytes/fetched_per_s"}


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def tensorboard_scalars(rec: dict[str, Any], prev: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics record, ``{tag: value}``.

    Rates (``shard/<k>/updates_per_s``, ``bytes/*_per_s``) are taken against ``prev``: the previous record,
    or ``{"wall_s": 0}`` (every counter zero) for the first record of a fresh run. Keys a strategy does not
    record are left out, and so is a rate whose counter went down (a shard restarted from an older checkpoint, or a
    resharded resume, starts its byte counters again) — a negative rate would be a lie, not a measurement.
    """
    out = {tag: x for key, tag in _PLAIN_SCALARS.items() if (x := _number(rec.get(key))) is not None}
    dt = (_number(rec.get("wall_s")) or 0.0) - (_number(prev.get("wall_s")) or 0.0)
    if dt <= 0:
        return out

    def rate(count: Any, count_before: Any) -> float | None:
        a, b = _number(count), _number(0 if count_before is None else count_before)
        if a is None or b is None or a < b:
            return None
        return (a - b) / dt

    for key, tag in _RATE_SCALARS.items():
        if key in rec and (r := rate(rec[key], prev.get(key))) is not None:
            out[tag] = r
    per_shard, before = rec.get("updates_per_shard") or [], prev.get("updates_per_shard") or []
    if len(before) != len(per_shard):  # a fresh run, or a resume onto a different number of shards
        before = [0] * len(per_shard)
    for k, (u, u0) in enumerate(zip(per_shard, before)):
        if (r := rate(u, u0)) is not None:
            out[f"shard/{k}/updates_per_s"] = r
    return out


class _TensorBoardLog:
    """Every metrics record's scalars into ``RUN_DIR/tensorboard/``, step = the record's ``updates``."""

    def __init__(self, out_dir: Path, prev: dict[str, Any] | None):
        # Imported here, not at module level: tensorboard (and protobuf) cost start-up time that runs without
        # --tensorboard should not pay.
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = out_dir / TENSORBOARD_DIR
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._prev = prev or {"wall_s": 0.0}

    def write(self, rec: dict[str, Any]) -> None:
        step = int(rec.get("updates") or 0)
        for tag, value in tensorboard_scalars(rec, self._prev).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()  # someone may be watching this run live
        self._prev = rec

    def close(self) -> None:
        self._writer.close()
