"""`distbelief simulate` and `distbelief plan` from the command line: output, files, errors named by flag."""

from __future__ import annotations

import json
import math

import pytest

from distbelief.cli import main
from distbelief.simulate.costs import Costs, load_costs
from distbelief.simulate.plan import candidates

FIG4 = ["--task", "speech", "--model", "speech-tiny", "--num-classes", "8192", "--batch-size", "128"]


def test_simulate_prints_the_prediction_and_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    rc = main(["simulate", *FIG4, "--nodes", "4", "--shared-cores", "2", "--shard-nodes", "2", "--bandwidth",
               "1gbit", "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "examples/s" in text and "bottleneck" in text and "staleness" in text
    pred = json.loads(out.read_text())["prediction"]
    assert pred["examples_per_s"] > 0 and math.isfinite(pred["staleness_mean"])
    assert set(pred["link_busy"]) == {f"node {n} {w}" for n in range(4) for w in ("up", "down")}
    assert png.stat().st_size > 10_000


def test_a_slow_link_is_named_and_compression_relieves_it(tmp_path, capsys):
    base = ["simulate", *FIG4, "--nodes", "4", "--shard-nodes", "2", "--cores-per-node", "4", "--bandwidth",
            "100mbit"]
    assert main([*base, "--json", str(tmp_path / "a.json")]) == 0
    assert main([*base, "--compress", "topk", "--compress-fetch", "delta", "--json", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    plain = json.loads((tmp_path / "a.json").read_text())["prediction"]
    topk = json.loads((tmp_path / "b.json").read_text())["prediction"]
    assert plain["bottleneck"].startswith("link")
    assert topk["examples_per_s"] > 5 * plain["examples_per_s"]


@pytest.mark.parametrize("args, flag", [
    (["--bandwidth", "fast"], "--bandwidth"),
    (["--nodes", "0"], "--nodes"),
    (["--stragglers", "7:2"], "--stragglers"),
    (["--stragglers", "0:0.5"], "--stragglers"),
    (["--strategy", "hogwild"], "--strategy"),
    (["--replicas", "0"], "--replicas"),
    (["--costs", "/nonexistent/costs.json"], "--costs"),
    (["--steps", "0"], "--steps"),
    (["--shard-nodes", "1"], "--shard-nodes"),
    (["--validate", "--repeats", "0"], "--repeats"),
])
def test_bad_input_is_refused_naming_the_flag(capsys, args, flag):
    assert main(["simulate", *args]) == 2
    assert f"error: {flag}" in capsys.readouterr().err


def test_a_costs_file_is_read_and_its_errors_named(tmp_path, capsys):
    path = tmp_path / "costs.json"
    fast = Costs(machine="twice as fast", macs_per_s={k: 2 * v for k, v in load_costs().macs_per_s.items()})
    fast.save(path)
    assert main(["simulate", *FIG4, "--replicas", "1", "--shards", "1", "--costs", str(path)]) == 0
    assert "twice as fast" in capsys.readouterr().out
    path.write_text(json.dumps({**fast.to_json(), "copy_bytes_per_s": -1}))
    assert main(["simulate", "--costs", str(path)]) == 2
    assert "copy_bytes_per_s" in capsys.readouterr().err


def test_validate_needs_measurements_and_reads_a_measured_file(tmp_path, capsys):
    assert main(["simulate", "--validate"]) == 2
    assert "--validate" in capsys.readouterr().err
    records = [{"name": f"r{r}", "settings": {"task": "speech", "model": "speech-tiny", "num_classes": 8192,
                                             "batch_size": 128, "replicas": r, "shards": 1},
                "machines": {"nodes": 1, "cores_per_node": 2}, "examples_per_s": 1000.0 * r,
                "examples_per_s_runs": [950.0 * r, 1050.0 * r],  # two rounds, as --repeats 2 keeps them
                "staleness_mean": r - 1.0} for r in (1, 2, 3)]
    (tmp_path / "measured.json").write_text(json.dumps({"records": records}))
    out = tmp_path / "cmp.json"
    assert main(["simulate", "--validate", "--measured", str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Kendall tau" in text and "the measurement against itself (2 rounds" in text
    c = json.loads(out.read_text())
    assert [r["name"] for r in c["rows"]] == ["r1", "r2", "r3"]
    assert all(r["predicted_examples_per_s"] > 0 for r in c["rows"])
    assert c["measurement"]["kendall_tau_between_rounds"] == 1 and c["measurement"]["pairs_swapped"] == []


def test_plan_suggests_flags_for_a_cluster(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "speech-tiny", "--num-classes", "8192", "--nodes", "8", "--cores-per-node", "4",
                 "--bandwidth", "1gbit", "--top", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "suggested: --replicas" in text and "why:" in text
    result = json.loads(out.read_text())
    speeds = [s["examples_per_s"] for s in result["settings"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == len(candidates(8, True, True))


def test_plan_refuses_a_model_it_does_not_know(capsys):
    assert main(["plan", "--model", "resnet", "--nodes", "2", "--cores-per-node", "2"]) == 2
    assert "--model" in capsys.readouterr().err
