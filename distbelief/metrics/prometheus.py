"""A Prometheus endpoint for a run (``--metrics-port``): what each evaluation recorded, as gauges a cluster's
Prometheus can scrape from the driver's machine at ``http://HOST:PORT/metrics``.

Every strategy's evaluations go through the run recorder, which updates the gauges here; between evaluations
they hold the last values. Gauges (all prefixed ``distbelief_``): ``examples_total``, ``examples_per_second``,
``test_accuracy`` (the run's metric), ``test_loss``, ``train_loss``, ``training_seconds``, ``updates_total``,
``replicas_alive``, ``staleness_mean`` / ``staleness_max`` (in updates, asynchronous strategies),
``shard_updates_total{shard}`` and ``shard_updates_per_second{shard}`` (per-shard update rate over the last
evaluation interval), ``bytes_pushed_total`` / ``bytes_fetched_total`` (through the shards). A model with
embedding tables adds ``rows_pushed_total`` / ``rows_fetched_total``, ``rows_pushed_per_second`` /
``rows_fetched_per_second`` (over the last interval) and ``shard_bytes_pushed_total{shard}`` /
``shard_bytes_fetched_total{shard}``. A gauge a strategy does not record stays absent rather than zero.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from distbelief.exceptions import ConfigError

_PLAIN = {  # record key -> (gauge name, help)
    "examples": ("examples_total", "training examples processed"),
    "examples_per_s": ("examples_per_second", "training examples per second of training time"),
    "test_accuracy": ("test_accuracy", "the run's metric on the test set (accuracy by default)"),
    "test_loss": ("test_loss", "mean loss on the test set"),
    "train_loss": ("train_loss", "the replicas' recent training loss"),
    "wall_s": ("training_seconds", "training time so far (evaluation pauses excluded)"),
    "updates": ("updates_total", "parameter updates applied"),
    "replicas_alive": ("replicas_alive", "replicas running"),
    "staleness_mean": ("staleness_mean", "mean staleness of the applied pushes, in updates"),
    "staleness_max": ("staleness_max", "largest staleness of an applied push, in updates"),
    "bytes_pushed": ("bytes_pushed_total", "gradient bytes pushed to the shards"),
    "bytes_fetched": ("bytes_fetched_total", "parameter bytes fetched from the shards"),
    "rows_pushed": ("rows_pushed_total", "embedding-table rows updated by the shards"),
    "rows_fetched": ("rows_fetched_total", "embedding-table rows fetched by the replicas"),
}
_RATES = {"rows_pushed": "rows_pushed_per_second", "rows_fetched": "rows_fetched_per_second"}
_PER_SHARD = {"bytes_pushed_per_shard": ("shard_bytes_pushed_total", "gradient bytes each shard read"),
              "bytes_fetched_per_shard": ("shard_bytes_fetched_total", "parameter bytes each shard served")}


class PrometheusExporter:
    """Serves one run's gauges on ``port`` (all interfaces) from a registry of its own, until ``close()``."""

    def __init__(self, port: int):
        self.registry = CollectorRegistry()
        self.gauges = {key: Gauge(f"distbelief_{name}", text, registry=self.registry)
                       for key, (name, text) in _PLAIN.items()}
        self.shard_updates = Gauge("distbelief_shard_updates_total", "updates applied by each parameter shard",
                                   ["shard"], registry=self.registry)
        self.shard_rate = Gauge("distbelief_shard_updates_per_second",
                                "updates per second of training time of each shard, over the last interval",
                                ["shard"], registry=self.registry)
        self.rates = {key: Gauge(f"distbelief_{name}", f"{key.replace('_', ' ')} per second of training time, "
                                 f"over the last interval", registry=self.registry) for key, name in _RATES.items()}
        self.per_shard = {key: Gauge(f"distbelief_{name}", text, ["shard"], registry=self.registry)
                          for key, (name, text) in _PER_SHARD.items()}
        self._last: tuple[float, list[int]] | None = None
        self._last_rows: dict[str, tuple[float, float]] = {}
        try:
            self.server, self.thread = start_http_server(port, registry=self.registry)
        except OSError as e:
            raise ConfigError("metrics_port", f"cannot serve metrics on port {port}: {e}") from None

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def update(self, rec: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            v = rec.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                gauge.set(v)
        per_shard, wall = rec.get("updates_per_shard"), rec.get("wall_s")
        if isinstance(per_shard, list) and isinstance(wall, (int, float)):
            for k, n in enumerate(per_shard):
                self.shard_updates.labels(shard=str(k)).set(n)
            if self._last is not None and wall > self._last[0] and len(self._last[1]) == len(per_shard):
                dt = wall - self._last[0]
                for k, (n, before) in enumerate(zip(per_shard, self._last[1])):
                    self.shard_rate.labels(shard=str(k)).set((n - before) / dt)
            self._last = (wall, list(per_shard))
        for key, gauge in self.per_shard.items():
            if isinstance(rec.get(key), list):
                for k, n in enumerate(rec[key]):
                    gauge.labels(shard=str(k)).set(n)
        for key, gauge in self.rates.items():
            n = rec.get(key)
            if not isinstance(n, (int, float)) or not isinstance(wall, (int, float)):
                continue
            before = self._last_rows.get(key)
            if before is not None and wall > before[0]:
                gauge.set((n - before[1]) / (wall - before[0]))
            self._last_rows[key] = (wall, n)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
