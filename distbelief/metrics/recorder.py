"""The run recorder: writes a run directory (resolved config, one JSON line per evaluation, a summary, a plot,
final parameters), shows live progress on the terminal and, with ``tensorboard``, the same records as
TensorBoard scalars; stops a diverged run.

Nothing in a run directory is a pickle: TOML, JSON lines, JSON, PNG, safetensors and TensorBoard event files
only.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import tomli_w

from distbelief.buffers import BUFFER_PREFIX
from distbelief.exceptions import DivergedError
from distbelief.files import atomic_write
from distbelief.metrics.divergence import DIVERGENCE_CEILING, DivergenceWatch, divergence_message
from distbelief.metrics.plots import plot_runs
from distbelief.metrics.prometheus import PrometheusExporter
from distbelief.metrics.rundir import last_record
from distbelief.metrics.tensorboard import _TensorBoardLog
from distbelief.summary import Evaluation


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class RunRecorder:
    """Writes the run directory and prints progress. ``out_dir=None`` records in memory only.

    Progress: a tqdm bar on a terminal, one plain line per record otherwise (both with updates, examples/s,
    the last test accuracy, staleness and the time left against ``max_seconds``). With
    ``config["tensorboard"]`` every record also goes to ``RUN_DIR/tensorboard/`` as TensorBoard scalars.
    """

    def __init__(self, out_dir: str | Path | None, config: dict[str, Any], quiet: bool = False,
                 write_config: bool = True, loss_ceiling: float = DIVERGENCE_CEILING, callbacks=(),
                 metrics_port: int = 0, metric_name: str = "accuracy"):
        self.out_dir = Path(out_dir) if out_dir else None
        # what the progress calls the run's metric (recorded as test_accuracy whatever it is: e.g. "AUC")
        self.metric_label = "acc" if metric_name == "accuracy" else metric_name
        self.callbacks = list(callbacks)  # the user's f(Evaluation), after each record
        # Prometheus gauges on metrics_port (0: none); a port in use is a ConfigError here, before any worker
        self.exporter = PrometheusExporter(metrics_port) if metrics_port else None
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
            prev = last_record(self.out_dir / "metrics.jsonl") if config.get("tensorboard") else None
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
        if self.exporter is not None:
            self.exporter.update(rec)
        if diverged:
            self.close_progress()
            raise DivergedError(divergence_message(self.config, rec.get("wall_s") or 0.0, diverged))
        if self.callbacks:
            evaluation = Evaluation.from_record(rec)
            for callback in self.callbacks:
                callback(evaluation)

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
                    self.metric_label: "-" if acc is None else f"{acc:.4f}"}
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
            f"  test {self.metric_label} {'-' if acc is None else f'{acc:.4f}'}"
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

    def close_exporter(self) -> None:
        """Stop serving the Prometheus endpoint (idempotent; the run ended, or failed)."""
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None

    def finish(self, summary: Any, flat_params=None, param_names=None, buffers=None) -> None:
        """Close the run: write ``summary.json``, the final parameters (``flat_params``, if given, with the module
        ``buffers`` by name) and the plot. ``summary`` is a dict, or any object with a ``to_dict()`` method
        (converted with it first)."""
        if not isinstance(summary, dict) and callable(getattr(summary, "to_dict", None)):
            summary = summary.to_dict()
        summary = _clean(summary)
        self.close_progress()
        self.close_exporter()
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

            tensors = {"flat_params": flat_params.detach().contiguous()}
            tensors.update({BUFFER_PREFIX + name: b.detach().contiguous() for name, b in (buffers or {}).items()})
            save_file(tensors, str(self.out_dir / "params.safetensors"))
        try:
            plot_runs([self.out_dir], self.out_dir / "accuracy.png")
        except Exception as e:  # noqa: BLE001 - a plot must never lose a finished run
            self.log(f"could not draw accuracy.png: {e}")
