"""Run directory: resolved config, one JSON line per evaluation, a summary, a plot, final parameters; live
progress on the terminal and, with ``tensorboard``, the same records as TensorBoard scalars.

Nothing in a run directory is a pickle: TOML, JSON lines, JSON, PNG, safetensors and TensorBoard event files
only.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import tomli_w

from distbelief.exceptions import DivergedError
from distbelief.files import atomic_write


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class Clock:
    """Training wall clock that can be paused (baselines pause it while they evaluate)."""

    def __init__(self, offset_s: float = 0.0):
        self._start = time.monotonic() - offset_s  # a resumed run continues its clock
        self._paused_total = 0.0
        self._paused_at: float | None = None

    def elapsed(self) -> float:
        now = self._paused_at if self._paused_at is not None else time.monotonic()
        return now - self._start - self._paused_total

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = time.monotonic()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_total += time.monotonic() - self._paused_at
            self._paused_at = None


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


class EvalSchedule:
    """When to evaluate next: every ``every_s`` seconds of training, stretched when one evaluation takes so long
    (a big model, a big test set) that evaluating would take more than ``SHARE`` of the run's wall-clock time.
    Every strategy's driver uses it, so their evaluations are spaced the same way; the user is told once."""

    SHARE = 0.1

    def __init__(self, every_s: float, log: Callable[[str], None] | None = None):
        self.every_s, self.log, self._told = every_s, log, False

    def interval(self, last_eval_s: float) -> float:
        """Training seconds from now to the next evaluation, given that the last one took ``last_eval_s``
        wall-clock seconds."""
        need = last_eval_s * (1 - self.SHARE) / self.SHARE
        if need <= self.every_s:
            return self.every_s
        if not self._told and self.log is not None:
            self._told = True
            self.log(f"an evaluation takes {last_eval_s:.1f}s: evaluating every {need:.0f}s of training instead "
                     f"of every {self.every_s:g}s (--eval-every-seconds), so that evaluation stays under "
                     f"{self.SHARE:.0%} of the run's time; --eval-samples N evaluates on fewer examples")
        return need


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


def _last_record(path: Path) -> dict[str, Any] | None:
    """The last record of an existing metrics.jsonl (a resumed run's rates continue from it), else None."""
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:  # a line cut short by a killed driver
        return None


# The divergence rule (DivergenceWatch). A loss counts as exploded when it is both many times the first
# evaluation's and large in absolute terms: the factor leaves room for the noise of a minibatch loss and for a
# run that gets worse for a while, the floor for runs whose first loss is already small (a resumed run, a warm
# start) — 10 nats is above the chance-level cross-entropy of every shipped task (ln 8192 = 9.0). A rate far too
# large explodes the loss within the first steps, before the first evaluation (the paper's model at Adagrad
# gamma = 0.05: 117 at 10 s, then flat), so a loss above the ceiling counts too: a mean cross-entropy of 50 nats
# gives the true class e^-50 on average, which no classifier does at initialization or while training. The
# ceiling holds for the default cross-entropy loss only: train() drops it for a custom loss_fn, whose scale it
# cannot know (a summed loss, say).
DIVERGENCE_FACTOR = 10.0
DIVERGENCE_FLOOR = 10.0
DIVERGENCE_CEILING = 50.0
_LOSS_NAMES = {"train_loss": "train loss", "test_loss": "test loss"}


class DivergenceWatch:
    """Tells from a run's metrics records whether training diverged, so that a run with too large a rate stops
    early with advice instead of spending its budget at chance accuracy.

    A record has diverged when its ``train_loss`` or ``test_loss`` is non-finite (nan, inf), is more than
    DIVERGENCE_FACTOR times the same loss at the first evaluation *and* more than DIVERGENCE_FLOOR, or is more
    than DIVERGENCE_CEILING. It fires once: a trainer that evaluates once more on its way out records that
    evaluation without a second error.
    """

    def __init__(self, ceiling: float = DIVERGENCE_CEILING):
        self.first: dict[str, float] = {}
        self.fired = False
        self.ceiling = ceiling

    def check(self, rec: dict[str, Any]) -> str | None:
        """The reason ``rec`` (raw: before non-finite values became None) shows divergence, else None."""
        if self.fired:
            return None
        for key, name in _LOSS_NAMES.items():
            v = rec.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v):
                self.fired = True
                return f"{name} {v}"
            first = self.first.setdefault(key, float(v))
            if v > DIVERGENCE_FACTOR * first and v > DIVERGENCE_FLOOR:
                self.fired = True
                return f"{name} {v:.4g} (was {first:.4g} at the first evaluation)"
            if v > self.ceiling:
                self.fired = True
                return f"{name} {v:.4g} (above {self.ceiling:g}: far beyond the loss of an untrained model)"
        return None


def divergence_message(config: dict[str, Any], wall_s: float, reason: str) -> str:
    """The DivergedError text: what diverged, and the flag to change with a value to try."""
    head = f"training diverged at {wall_s:.1f}s: {reason}"
    if config.get("strategy") == "sandblaster":
        return (f"{head}; sandblaster's L-BFGS chooses its own steps by line search and takes no --lr: try a "
                f"larger --batch-size (now {config.get('batch_size')}) or a smaller --history (now "
                f"{config.get('history')})")
    lr = config.get("lr")
    if not isinstance(lr, (int, float)) or not lr > 0:
        return f"{head}; lower the learning rate (--lr)"
    return f"{head}; lower the learning rate, e.g. --lr {lr / 10:g} (now {lr:g})"


class RunRecorder:
    """Writes the run directory and prints progress. ``out_dir=None`` records in memory only.

    Progress: a tqdm bar on a terminal, one plain line per record otherwise (both with updates, examples/s,
    the last test accuracy, staleness and the time left against ``max_seconds``). With
    ``config["tensorboard"]`` every record also goes to ``RUN_DIR/tensorboard/`` as TensorBoard scalars.
    """

    def __init__(self, out_dir: str | Path | None, config: dict[str, Any], quiet: bool = False,
                 write_config: bool = True, loss_ceiling: float = DIVERGENCE_CEILING):
        self.out_dir = Path(out_dir) if out_dir else None
        self.records: list[dict[str, Any]] = []
        self.quiet = quiet
        self.config = config
        self._bar = None
        self._bar_checked = False
        self._tensorboard: _TensorBoardLog | None = None
        self._divergence = DivergenceWatch(loss_ceiling)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if write_config:
                self.write_config()
            prev = _last_record(self.out_dir / "metrics.jsonl") if config.get("tensorboard") else None
            self._metrics = open(self.out_dir / "metrics.jsonl", "a", buffering=1)
            if config.get("tensorboard"):
                self._tensorboard = _TensorBoardLog(self.out_dir, prev)
        else:
            self._metrics = None
            if config.get("tensorboard"):
                warnings.warn("tensorboard has no effect without a run directory; set out (--out DIR) to "
                              "write TensorBoard scalars", stacklevel=2)

    def write_config(self) -> None:
        """Write the resolved ``config.toml``. A resume calls it only once its overrides were accepted, so that a
        refused override never replaces the run's configuration."""
        if self.out_dir is not None:
            cfg = {k: v for k, v in self.config.items() if v is not None}
            (self.out_dir / "config.toml").write_text(tomli_w.dumps(cfg))

    def log(self, message: str) -> None:
        if self.quiet:
            return
        line = f"[distbelief] {message}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def _progress_bar(self):
        """A tqdm bar on a terminal; None (plain lines) otherwise."""
        if self.quiet or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        total = self.config.get("max_seconds") or None
        try:
            width = os.get_terminal_size(sys.stderr.fileno()).columns
        except OSError:
            width = 0
        sized = width > 0  # a terminal that reports no size (e.g. a bare pty) gets a fixed width
        # n is the run's training clock (tqdm's own {elapsed} would count from the first evaluation, and its
        # {remaining} is an estimate); the time left against max_seconds is exact and sits in the postfix.
        return tqdm(total=total, unit="s", file=sys.stderr, dynamic_ncols=sized, ncols=None if sized else 120,
                    nrows=None if sized else 24,
                    bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s{postfix}"
                    if total else "{n:.0f}s (no time limit){postfix}")

    def record(self, rec: dict[str, Any]) -> None:
        """Write and show one evaluation. Raises DivergedError (after writing it) when the loss diverged: every
        strategy records its evaluations here, so every strategy stops on it, through its own cleanup."""
        diverged = self._divergence.check(rec)  # on the raw values: _clean turns nan and inf into None
        rec = _clean(rec)
        self.records.append(rec)
        if self._metrics is not None:
            self._metrics.write(json.dumps(rec) + "\n")
        if self._tensorboard is not None:
            self._tensorboard.write(rec)
        self._show(rec)
        if diverged:
            self.close_progress()
            raise DivergedError(divergence_message(self.config, rec.get("wall_s") or 0.0, diverged))

    def _show(self, rec: dict[str, Any]) -> None:
        """The progress bar's update, or one plain line."""
        if self.quiet:
            return
        acc, loss = rec.get("test_accuracy"), rec.get("train_loss")
        if self._bar is None and self._bar_checked is False:
            self._bar_checked = True
            self._bar = self._progress_bar()
        if self._bar is not None:
            post = {"updates": rec.get("updates", 0), "ex/s": f"{rec.get('examples_per_s', 0):,.0f}",
                    "acc": "-" if acc is None else f"{acc:.4f}"}
            if rec.get("staleness_mean") is not None:
                post["staleness"] = f"{rec['staleness_mean']:.2f}"
            if self._bar.total:
                post["left"] = f"{max(0.0, self._bar.total - rec['wall_s']):.0f}s"
            self._bar.set_postfix(post, refresh=False)
            total = self._bar.total
            self._bar.update(max(0.0, min(rec["wall_s"], total or rec["wall_s"]) - self._bar.n))
            return
        line = (
            f"[{rec['wall_s']:7.1f}s] updates {rec.get('updates', 0):>8}  examples {rec.get('examples', 0):>9}"
            f"  ({rec.get('examples_per_s', 0):,.0f}/s)"
            f"  train loss {'-' if loss is None else f'{loss:.4f}'}"
            f"  test acc {'-' if acc is None else f'{acc:.4f}'}"
        )
        if rec.get("staleness_mean") is not None:
            line += f"  staleness {rec['staleness_mean']:.2f}"
        max_s = self.config.get("max_seconds")
        if max_s:
            line += f"  time left {max(0.0, max_s - rec['wall_s']):.0f}s"
        print(line, file=sys.stderr, flush=True)

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def finish(self, summary: dict[str, Any], flat_params=None, param_names=None) -> None:
        summary = _clean(summary)
        self.close_progress()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self.out_dir is None:
            return
        if self._metrics is not None:
            self._metrics.close()
        atomic_write(self.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n", durable=False)
        if flat_params is not None:
            from safetensors.torch import save_file

            save_file({"flat_params": flat_params.detach().contiguous()}, str(self.out_dir / "params.safetensors"))
        try:
            plot_runs([self.out_dir], self.out_dir / "accuracy.png")
        except Exception as e:  # noqa: BLE001 - a plot must never lose a finished run
            self.log(f"could not draw accuracy.png: {e}")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; is it a distbelief run directory?")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot_runs(run_dirs: list[str | Path], out_png: str | Path) -> Path:
    """Overlay test accuracy (and train loss) vs wall-clock time of one or more runs into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for d in run_dirs:
        recs = read_metrics(d)
        label = Path(d).name
        summ = Path(d) / "summary.json"
        if summ.is_file():
            s = json.loads(summ.read_text())
            label = f"{label} ({s.get('strategy')}, {s.get('replicas')}r)"
        t = [r["wall_s"] for r in recs]
        ax_acc.plot(t, [r.get("test_accuracy") for r in recs], marker=".", label=label)
        ax_loss.plot(t, [r.get("train_loss") for r in recs], marker=".", label=label)
    ax_acc.set(xlabel="wall-clock time (s)", ylabel="test accuracy", title="test accuracy")
    ax_loss.set(xlabel="wall-clock time (s)", ylabel="train loss", title="training loss")
    ax_acc.grid(alpha=0.3)
    ax_loss.grid(alpha=0.3)
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
