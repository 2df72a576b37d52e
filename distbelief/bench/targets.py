"""Target maths of the Fig. 4/5 sweeps: a run's metrics as series, the time to a target accuracy, and the
issue's targets as ratios of the times measured in a sweep (and their report in the log).

Time to target is the training time of the first evaluation at or above the target accuracy.
"""

from __future__ import annotations


def series_of(metrics: list[dict]) -> dict[str, list]:
    keys = ("wall_s", "test_accuracy", "train_accuracy", "train_loss", "examples", "updates", "staleness_mean")
    return {k: [m.get(k) for m in metrics] for k in keys}


def time_to_target(series: dict[str, list], target: float, window: int = 1) -> float | None:
    """Training time of the first evaluation at which the mean test accuracy of the last ``window`` evaluations
    is at or above ``target`` (``window`` 1: the first crossing; larger windows discount one lucky evaluation)."""
    accs = [(t, a) for t, a in zip(series["wall_s"], series["test_accuracy"]) if a is not None]
    for i in range(window - 1, len(accs)):
        if sum(a for _, a in accs[i - window + 1:i + 1]) / window >= target:
            return accs[i][0]
    return None


def _tta(runs: list[dict], method: str, cores: int) -> float | None:
    for r in runs:
        if r["method"] == method and r["cores"] == cores:
            return r["time_to_target_s"]
    return None


def evaluate_targets(figure: str, runs: list[dict], cores: int) -> list[dict]:
    """The issue's targets as ratios of times measured in this sweep (None where a run is missing or missed)."""
    def ratio(a: str, b: str, ca: int, cb: int, threshold: float, text: str, strict: bool = False) -> dict:
        ta, tb = _tta(runs, a, ca), _tta(runs, b, cb)
        value = ta / tb if ta is not None and tb is not None and tb > 0 else None
        if ta is not None and tb is None and any(r["method"] == b and r["cores"] == cb for r in runs):
            met = True  # b missed the target within the budget, a reached it: a is faster whatever b's time
        elif value is None:
            met = None
        else:
            met = value < threshold if strict else value <= threshold
        return {"name": f"{a}@{ca} vs {b}@{cb}", "description": text, "ratio": value, "threshold": threshold,
                "met": met}

    if figure == "fig4":
        return [
            ratio("downpour-adagrad", "sgd-1", cores, 1, 0.6,
                  f"Downpour + Adagrad ({cores} replicas) reaches the target in <= 0.6x the time of single-process "
                  f"SGD with 1 thread"),
            ratio("downpour-adagrad", "sgd-all", cores, cores, 1.0,
                  f"Downpour + Adagrad ({cores} replicas) reaches the target in less time than single-process SGD "
                  f"with {cores} threads", strict=True),
            ratio("downpour-adagrad", "downpour-sgd", cores, cores, 1.0,
                  "Downpour + Adagrad reaches the target no later than Downpour with a fixed rate"),
        ]
    out = []
    for c in sorted({r["cores"] for r in runs}):
        out.append(ratio("downpour-adagrad", "downpour-sgd", c, c, 1.0,
                         f"at {c} cores, Downpour + Adagrad no later than Downpour with a fixed rate"))
    return out


def report_targets(res: dict, log) -> None:
    """Log each of a sweep's evaluated targets: met, not met or not measured, with its ratio and threshold."""
    for t in res["targets"]:
        state = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        value = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        log(f"[{res['figure']}] target {state}: {t['description']} (ratio {value}, threshold {t['threshold']})")
