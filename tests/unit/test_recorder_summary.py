"""RunRecorder.finish takes the summary as a dict or as any object with a to_dict() method."""

import json
import math

from distbelief.metrics import RunRecorder


class _Summary:
    def to_dict(self):
        return {"strategy": "sgd", "replicas": 1, "test_accuracy": math.nan}


def test_finish_accepts_an_object_with_to_dict(tmp_path):
    rec = RunRecorder(tmp_path / "run", {"strategy": "sgd"}, quiet=True)
    rec.record({"wall_s": 1.0, "updates": 1, "test_accuracy": 0.5, "train_loss": 1.0})
    rec.finish(_Summary())
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {
        "strategy": "sgd", "replicas": 1, "test_accuracy": None}


def test_finish_still_takes_a_dict(tmp_path):
    rec = RunRecorder(tmp_path / "run", {}, quiet=True)
    rec.finish({"wall_s": 2.0})
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"wall_s": 2.0}
