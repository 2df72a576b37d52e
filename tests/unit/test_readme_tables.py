"""The benchmark tables of README.md and benchmarks/RESULTS.md are what benchmarks/readme_tables.py renders from
the results.json each cites: a number edited by hand, or a results file that changed, fails here."""

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKED = ["README.md", "benchmarks/RESULTS.md"]


def load_script():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rt():
    return load_script()


def blocks(text: str) -> list[tuple[list[str], str]]:
    """(paths, generated text) of every marked table."""
    return [(m[1].split(), m[2]) for m in re.finditer(r"<!-- table: ([^>]+?) -->\n(.*?)<!-- end table -->", text,
                                                      re.DOTALL)]


def test_the_repository_tables_agree_with_their_results_files(rt, capsys):
    readme = (ROOT / "README.md").read_text()
    found = blocks(readme)
    assert len(found) >= 3  # throughput, the latest fig4 sweep, the fig4 ordering
    for paths, body in found:
        assert all((ROOT / p).is_file() for p in paths), paths
        assert body.count("\n|") >= 3, paths  # a header, a rule and rows: never an empty block
    assert rt.main(["--check", *MARKED]) == 0, capsys.readouterr()


def test_a_number_changed_by_hand_fails_the_check_and_regenerating_restores_it(rt, tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    _, body = next(b for b in blocks(readme) if "throughput" in b[0][0])
    number = re.search(r"\| \*\*([\d,]+) \(", body)[1]  # Downpour's examples/s on the first model
    bad = readme.replace(body, body.replace(f"**{number} (", f"**{int(number.replace(',', '')) + 1:,} (", 1))
    assert bad != readme
    copy = tmp_path / "README.md"
    copy.write_text(bad)
    assert rt.main(["--check", str(copy), "--root", str(ROOT)]) == 1
    out = capsys.readouterr().out
    assert f"**{number} (" in out  # the difference names the recorded number
    assert rt.main([str(copy), "--root", str(ROOT)]) == 0  # regenerate
    assert copy.read_text() == readme
    assert rt.main(["--check", str(copy), "--root", str(ROOT)]) == 0


def test_a_changed_results_file_fails_the_check(rt, tmp_path):
    readme = (ROOT / "README.md").read_text()
    paths, _ = next(b for b in blocks(readme) if "throughput" in b[0][0])
    rel = paths[0]
    root = tmp_path / "root"
    for p in {q for ps, _ in blocks(readme) for q in ps}:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / p, root / p)
    res = json.loads((root / rel).read_text())
    res["models"]["paper"]["methods"]["downpour"]["median_examples_per_s"] *= 1.1
    (root / rel).write_text(json.dumps(res))
    (root / "README.md").write_text(readme)
    assert rt.main(["--check", str(root / "README.md"), "--root", str(root)]) == 1
    (root / rel).write_text((ROOT / rel).read_text())
    assert rt.main(["--check", str(root / "README.md"), "--root", str(root)]) == 0


def test_a_fig4_table_is_rendered_from_the_runs_series(rt):
    """The fig4 numbers come from the runs' evaluations by the smoothed crossing, medians over repeats."""
    def run(method, cores, accs, repeat=1):
        return {"method": method, "cores": cores, "label": method, "repeat": repeat, "examples_per_s": 100.0,
                "best_test_accuracy": max(accs), "time_to_target_s": None,
                "series": {"wall_s": [5.0 * (i + 1) for i in range(len(accs))], "test_accuracy": accs}}

    rise = [0.10, 0.11, 0.12, 0.13, 0.14, 0.15, 0.15, 0.15]
    late = [0.10, 0.11, 0.12, 0.12, 0.13, 0.14, 0.15, 0.15, 0.15]
    res = {"figure": "fig4", "target_accuracy": 0.13, "cores": 2, "runs": [
        run("sgd-1", 1, late), run("sgd-all", 2, rise), run("downpour-adagrad", 2, rise),
        run("downpour-adagrad", 2, late, 2), run("downpour-adagrad", 2, rise, 3)]}
    lines = rt.fig4_table(res)
    da = next(x for x in lines if x.startswith("| downpour-adagrad"))
    assert "| 3 |" in da and "20.0 (20.0–25.0)" in da and "0.80×" in da  # median 20 s over sgd-1's 25 s


def test_a_marker_without_its_end_is_an_error(rt, tmp_path, capsys):
    f = tmp_path / "x.md"
    f.write_text("<!-- table: benchmarks/results/throughput-2026-12-05-defaults/results.json -->\n| a |\n")
    assert rt.main(["--check", str(f), "--root", str(ROOT)]) == 2
    assert "has no `<!-- end table -->`" in capsys.readouterr().err
