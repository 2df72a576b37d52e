"""--metrics-port: a Prometheus endpoint a cluster user can scrape, tested by scraping it during a run."""

import socket
import urllib.request

import pytest

from distbelief import ConfigError, train
from tests.conftest import make_odd_model
from tests.integration.test_python_api import TEST, TRAIN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("distbelief_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_a_run_serves_its_metrics_while_it_trains_and_stops_serving_after(tmp_path):
    port = free_port()
    scraped = []

    def scrape_during_the_run(evaluation):
        # two evaluations can fall between the same two steps (they run every 0.02 s): scrape only after progress
        seen = scraped[-1][0].examples if scraped else 0
        if len(scraped) < 2 and evaluation.examples > seen:
            scraped.append((evaluation, scrape(port)))

    res = train(make_odd_model, TRAIN, TEST, strategy="downpour", runtime="inprocess", replicas=2, shards=2,
                max_steps=60, max_seconds=0, eval_every_seconds=0.02, quiet=True, metrics_port=port,
                callbacks=[scrape_during_the_run])
    assert len(scraped) == 2
    (first, m1), (second, m2) = scraped
    assert m2["distbelief_examples_total"] == second.examples > m1["distbelief_examples_total"] == first.examples
    assert m2["distbelief_test_accuracy"] == pytest.approx(second.test_accuracy)
    assert m2["distbelief_examples_per_second"] == pytest.approx(second.examples_per_s)
    assert m2["distbelief_staleness_max"] == second.values["staleness_max"]
    per_shard = second.values["updates_per_shard"]
    assert [m2[f'distbelief_shard_updates_total{{shard="{k}"}}'] for k in range(2)] == per_shard
    assert all(m2[f'distbelief_shard_updates_per_second{{shard="{k}"}}'] >= 0 for k in range(2))
    assert m2["distbelief_bytes_pushed_total"] == second.values["bytes_pushed"] > 0
    assert res.summary["stop_reason"] == "step limit reached"
    with pytest.raises(OSError):  # the endpoint closed with the run
        scrape(port)


def test_a_port_in_use_is_refused_naming_the_setting():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match="^metrics_port: cannot serve metrics on port"):
            train(make_odd_model, TRAIN, TEST, strategy="sgd", max_steps=2, max_seconds=0, quiet=True,
                  metrics_port=port)
