"""Sandblaster's durable iteration state: state files, consistent pairs, reslicing (no processes)."""

import json

import pytest
import torch

from distbelief.exceptions import ConfigError
from distbelief.ps.shard import ParameterShard
from distbelief.ps.sharding import ShardLayout
from distbelief.sandblaster.state import (CorruptState, find_resume_point, read_state, resliced_shard, state_path,
                                          tidy, vectors_root, write_state)

TOTAL = 23
NAMES = ("x", "d", "g0", "g1", "s0", "y0", "s1", "y1")


def full_vectors(tag: int) -> dict[str, torch.Tensor]:
    """Distinct, recognisable values for every named vector (and the iteration tag) of a 23-parameter model."""
    base = torch.arange(TOTAL, dtype=torch.float32)
    out = {"params": base + 1000 * tag}
    for i, name in enumerate(NAMES):
        out[name] = base * (i + 2) - 7 * i + 1000 * tag
    return out


def write_pair(root, tag: int, num_shards: int, write_state_file: bool = True) -> list[tuple[int, int]]:
    """What one iteration checkpoint leaves on disk: every shard's vector file, then the state file."""
    layout = ShardLayout.balanced(TOTAL, num_shards)
    vecs = full_vectors(tag)
    ranges = [layout.range(k) for k in range(num_shards)]
    for k, (lo, hi) in enumerate(ranges):
        shard = ParameterShard(k, lo, hi, vecs["params"][lo:hi].numpy(), None, TOTAL)
        for name in NAMES:
            shard.vectors[name] = vecs[name][lo:hi].clone()
        shard.checkpoint_vectors(str(root), tag)
    if write_state_file:
        write_state(root, tag, {"tag": tag, "total": TOTAL, "shards": [list(r) for r in ranges],
                                "coordinator": {"iterations": tag, "f": 0.25}})
    return ranges


def test_state_round_trip_keeps_the_newest_three_and_detects_damage(tmp_path):
    for tag in range(5):
        write_state(tmp_path, tag, {"tag": tag, "total": TOTAL, "f": 0.1 + tag, "gram": [["s0", "y0", 1e-300]]})
    assert sorted(p.name for p in vectors_root(tmp_path).glob("state-*.json")) == [
        f"state-{t:012d}.json" for t in (2, 3, 4)]
    assert read_state(state_path(tmp_path, 4)) == {"tag": 4, "total": TOTAL, "f": 4.1,
                                                   "gram": [["s0", "y0", 1e-300]]}  # floats exactly
    p = state_path(tmp_path, 4)
    p.write_text(p.read_text().replace("4.1", "4.2"))  # still valid JSON: only the checksum can tell
    with pytest.raises(CorruptState, match="checksum"):
        read_state(p)
    p.write_text(p.read_text()[:40])  # truncated
    with pytest.raises(CorruptState, match=r"state-000000000004\.json: unreadable"):
        read_state(p)
    with pytest.raises(ValueError, match="names tag"):
        write_state(tmp_path, 5, {"tag": 4})
    with pytest.raises(ValueError):  # strict JSON: a NaN must be encoded by the caller
        write_state(tmp_path, 5, {"tag": 5, "f": float("nan")})


@pytest.mark.parametrize("old_k,new_k", [(2, 3), (3, 2), (2, 2), (1, 4)])
def test_resliced_shards_hold_every_named_vector_of_the_old_ones(tmp_path, old_k, new_k):
    ranges = write_pair(tmp_path, 6, old_k)
    layout = ShardLayout.balanced(TOTAL, new_k)
    shards = [resliced_shard(str(tmp_path), 6, ranges, k, *layout.range(k), TOTAL) for k in range(new_k)]
    expected = full_vectors(6)
    for name, values in expected.items():
        torch.testing.assert_close(torch.cat([s.vectors[name] for s in shards]), values, rtol=0, atol=0)
    fetched, _ = shards[-1].fetch()  # params shares memory with what fetch() returns, as for any shard
    assert fetched.tolist() == expected["params"][layout.range(new_k - 1)[0]:].tolist()


def test_a_crash_between_the_vectors_and_the_state_resumes_from_the_previous_pair(tmp_path):
    write_pair(tmp_path, 3, 2)
    write_pair(tmp_path, 4, 2, write_state_file=False)  # killed before the state file of tag 4
    point = find_resume_point(tmp_path, TOTAL)
    assert point.tag == 3 and point.state["coordinator"]["iterations"] == 3 and not point.skipped
    assert point.next_tag == 5  # never 4 again: no state may be paired with a rewritten vector file


def test_damaged_or_missing_vectors_fall_back_and_name_the_file(tmp_path):
    write_pair(tmp_path, 3, 2)
    write_pair(tmp_path, 4, 2)
    write_pair(tmp_path, 5, 2)
    newest = vectors_root(tmp_path) / "shard-001" / f"ckpt-{5:012d}.safetensors"
    raw = bytearray(newest.read_bytes())
    raw[-3] ^= 0xFF
    newest.write_bytes(bytes(raw))
    (vectors_root(tmp_path) / "shard-000" / f"ckpt-{4:012d}.safetensors").unlink()
    point = find_resume_point(tmp_path, TOTAL)
    assert point.tag == 3
    assert "shard-001" in point.skipped[0] and "checksum" in point.skipped[0]
    assert "shard-000" in point.skipped[1] and "missing" in point.skipped[1]


def test_no_usable_pair_and_a_different_model_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="^resume: .*holds no Sandblaster iteration state"):
        find_resume_point(tmp_path, TOTAL)
    write_pair(tmp_path, 3, 2)
    with pytest.raises(ConfigError, match=r"^model: .*state-000000000003\.json.* 23 parameters, this model has 24"):
        find_resume_point(tmp_path, TOTAL + 1)
    state_path(tmp_path, 3).write_text("{")
    with pytest.raises(ConfigError, match=r"^resume: no consistent .*state-000000000003\.json: unreadable.*"
                                          r"start a new run"):
        find_resume_point(tmp_path, TOTAL)


def test_tidy_drops_shard_directories_no_kept_state_needs(tmp_path):
    write_pair(tmp_path, 3, 3)
    (vectors_root(tmp_path) / "shard-002" / ".ckpt-000000000004.safetensors.tmp99").write_bytes(b"torn")
    tidy(tmp_path)
    assert (vectors_root(tmp_path) / "shard-002").is_dir()  # state 3 needs it
    assert not list(vectors_root(tmp_path).glob("shard-*/.ckpt-*"))
    for tag in (4, 5, 6):  # resumed with 2 shards: three new states push the 3-shard one out
        write_pair(tmp_path, tag, 2)
    tidy(tmp_path)
    assert not (vectors_root(tmp_path) / "shard-002").exists()
    assert find_resume_point(tmp_path, TOTAL).tag == 6
    assert json.loads(state_path(tmp_path, 6).read_text())["state"]["shards"] == [[0, 12], [12, 23]]
