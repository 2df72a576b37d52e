"""The click-through-rate workload under Downpour: dlrm-small's 26 tables held row-sharded, in process."""

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.data.ctr import CRITEO_CARDINALITIES


def test_downpour_learns_the_planted_click_model_with_row_sharded_tables():
    cfg = RunConfig(task="ctr", model="dlrm-small", ctr_max_rows=5000, num_samples=60000, runtime="inprocess",
                    replicas=2, shards=2, max_steps=150, max_seconds=0, eval_every_seconds=3600, batch_size=128,
                    durability="off")
    s = train_task(cfg, quiet=True).summary
    assert s["table_rows"] == sum(min(c, 5000) for c in CRITEO_CARDINALITIES)
    assert s["updates_per_shard"] == [300, 300] and s["rejected_pushes"] == 0
    # 38k examples from scratch: well on the way to the planted optimum (0.82 here), and never past it
    assert 0.75 <= s["best_test_auc"] < s["planted_auc"]
    assert 0 < s["test_logloss"] < 0.55
    # each step moved only the rows it touched: at most 128 x 26 ids, far fewer than the tables' rows
    steps = sum(s["steps_per_replica"])
    assert 0 < s["rows_pushed"] / steps <= 128 * 26 < s["table_rows"]
