"""Sandblaster's durable iteration state: the coordinator's scalars next to the shards' vector checkpoints.

At each iteration checkpoint every shard writes all its named vectors as ``shard-KKK/ckpt-TAG.safetensors``
(``ParameterShard.checkpoint_vectors``). Once every shard has, the driver writes ``state-TAG.json`` beside them:
the coordinator's scalars (which ring slots hold which (s, y) pair, the Gram matrix, the loss, the batch, the
counters) and the trainer's (training clock, best accuracy, restarts), with the shard ranges, checksummed and
atomic (temporary file, fsync, rename, directory fsync)::

    RUN_DIR/checkpoints/sandblaster/state-000000000012.json
    RUN_DIR/checkpoints/sandblaster/shard-000/ckpt-000000000012.safetensors   (one per shard)

Why a pair is always consistent:

* a state file is written only after every vector checkpoint of its tag was acknowledged, so a crash between the
  two leaves a tag without a state, which resume ignores — it takes the previous pair (the newest ``keep`` = 3
  of each are kept);
* tags only grow: within a run a tag is reused only when its save failed (no state names it), and a resumed run
  starts above every tag on disk, so no state file is ever paired with a vector checkpoint rewritten after it;
* on resume every vector checkpoint a state names is verified (SHA-256, range, tag) before it is used; a state
  whose vectors are damaged or missing, or a damaged state file, is skipped for the previous pair, and the user
  is told which file.

JSON and safetensors only; nothing here unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distbelief.exceptions import ConfigError
from distbelief.files import atomic_write
from distbelief.ps.checkpoint import CorruptCheckpoint, load_checkpoint, shard_dir
from distbelief.ps.shard import PARAMS, ParameterShard

STATE_FORMAT = "distbelief-sandblaster-state/1"


class CorruptState(Exception):
    """A state file that cannot be read, is not ours, or whose checksum does not match."""


def vectors_root(ckpt_root: str | Path) -> Path:
    """Where the vector checkpoints and state files of a run's checkpoint directory live."""
    return Path(ckpt_root) / ParameterShard.VECTOR_CKPT_DIR


def state_path(ckpt_root: str | Path, tag: int) -> Path:
    return vectors_root(ckpt_root) / f"state-{int(tag):012d}.json"


def _vector_path(ckpt_root: str | Path, shard_id: int, tag: int) -> Path:
    return shard_dir(vectors_root(ckpt_root), shard_id) / f"ckpt-{int(tag):012d}.safetensors"


def _canonical(payload: dict) -> str:
    return json.dumps(payload, sort_keys=True, allow_nan=False, separators=(",", ":"))


def write_state(ckpt_root: str | Path, tag: int, payload: dict, keep: int = 3) -> Path:
    """Atomically write ``payload`` (JSON-able, must hold ``tag``) as ``state-TAG.json``; keep the newest ``keep``.

    Call it only once every shard's vector checkpoint ``tag`` is written (that is what makes the pair consistent).
    Rewriting the state of the same tag later (fresher trainer numbers) is safe: its vectors never change.
    """
    if payload.get("tag") != tag:
        raise ValueError(f"state payload names tag {payload.get('tag')!r}, not {tag}")
    d = vectors_root(ckpt_root)
    d.mkdir(parents=True, exist_ok=True)
    body = _canonical(payload)
    doc = {"format": STATE_FORMAT, "sha256": hashlib.sha256(body.encode()).hexdigest(), "state": payload}
    final = atomic_write(state_path(ckpt_root, tag), json.dumps(doc, sort_keys=True, allow_nan=False) + "\n")
    for old in sorted(d.glob("state-*.json"))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def read_state(path: str | Path) -> dict:
    """The verified payload of one state file; CorruptState (naming the file and why) on any damage."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptState(f"{p}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or not isinstance(doc.get("state"), dict):
        raise CorruptState(f"{p}: not a Sandblaster state file (expected format {STATE_FORMAT!r})")
    payload = doc["state"]
    if hashlib.sha256(_canonical(payload).encode()).hexdigest() != doc.get("sha256"):
        raise CorruptState(f"{p}: checksum mismatch (the file was changed or damaged after it was written)")
    tag = payload.get("tag")
    if not isinstance(tag, int) or f"state-{tag:012d}" != p.stem:
        raise CorruptState(f"{p}: describes tag {payload.get('tag')!r}, not the one in its name")
    return payload


@dataclass
class ResumePoint:
    """The consistent pair a resumed run continues from."""

    tag: int
    path: Path  # its state file
    state: dict  # the state file's payload
    next_tag: int  # the first tag the resumed run may write: above every tag on disk
    skipped: list[str] = field(default_factory=list)  # newer pairs passed over, each naming its bad file


def _tags_on_disk(ckpt_root: str | Path) -> list[int]:
    d = vectors_root(ckpt_root)
    names = [p.stem for p in d.glob("state-*.json")] + [p.stem for p in d.glob("shard-*/ckpt-*.safetensors")]
    tags = []
    for name in names:
        try:
            tags.append(int(name.split("-")[1]))
        except (IndexError, ValueError):
            continue
    return tags


def _check_vectors(ckpt_root: str | Path, state: dict, state_file: Path) -> str | None:
    """Why the vector checkpoints that ``state`` names cannot be used with it, or None if they verify."""
    tag, total = state["tag"], state["total"]
    ranges = [tuple(r) for r in state["shards"]]
    tiled = bool(ranges) and ranges[0][0] == 0 and ranges[-1][1] == total and all(
        a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if not tiled:
        return f"{state_file}: its shard ranges {ranges} do not cover [0, {total})"
    names = None
    for j, (lo, hi) in enumerate(ranges):
        path = _vector_path(ckpt_root, j, tag)
        if not path.is_file():
            return f"{path}: missing (named by {state_file.name})"
        try:
            meta, tensors = load_checkpoint(path)
        except CorruptCheckpoint as e:
            return str(e)
        if (meta.get("lo"), meta.get("hi"), meta.get("total"), meta.get("version")) != (lo, hi, total, tag):
            return (f"{path}: holds [{meta.get('lo')}, {meta.get('hi')}) of {meta.get('total')} at tag "
                    f"{meta.get('version')}, but {state_file.name} expects [{lo}, {hi}) of {total} at tag {tag}")
        have = {k[4:] for k in tensors if k.startswith("vec.")}
        if PARAMS not in have or (names is not None and have != names):
            return f"{path}: holds the vectors {sorted(have)}, the other shards {sorted(names or [])}"
        names = have
    return None


def find_resume_point(ckpt_root: str | Path, total: int) -> ResumePoint:
    """The newest consistent (state, vector checkpoints) pair under ``ckpt_root``.

    Raises:
        ConfigError: ``model`` if the run trained a model with another parameter count; ``resume`` if there is
            no usable pair (each damaged file is named, with what to do).
    """
    d = vectors_root(ckpt_root)
    states = sorted(d.glob("state-*.json"), reverse=True)
    if not states:
        raise ConfigError("resume", f"{d} holds no Sandblaster iteration state (state-*.json): the run stopped "
                                    f"before its first iteration checkpoint, or it was not a sandblaster run; "
                                    f"start a new run (another --out)")
    skipped: list[str] = []
    for p in states:
        try:
            state = read_state(p)
        except CorruptState as e:
            skipped.append(str(e))
            continue
        if state["total"] != total:
            raise ConfigError("model", f"{p}: the run trains a model with {state['total']:,} parameters, this model "
                                       f"has {total:,}; resume with the same model (task, model, num_classes, "
                                       f"num_samples) or start a new run in another directory")
        problem = _check_vectors(ckpt_root, state, p)
        if problem is not None:
            skipped.append(problem)
            continue
        return ResumePoint(state["tag"], p, state, max(_tags_on_disk(ckpt_root)) + 1, skipped)
    raise ConfigError("resume", f"no consistent Sandblaster checkpoint under {d}: " + "; ".join(skipped) +
                      ". Nothing there can be resumed; start a new run (another --out)")


def resliced_shard(ckpt_root: str, tag: int, old_ranges: list[tuple[int, int]], shard_id: int, lo: int, hi: int,
                   total: int) -> ParameterShard:
    """A vector-only shard owning ``[lo, hi)`` with every named vector of iteration checkpoint ``tag``, cut from the
    old shards' files that overlap it (``old_ranges[j]`` is old shard j's range; any number of old shards).

    Runs where the shard will live (a Ray actor reads the files itself), so the driver never holds the vectors.
    """
    parts: dict[str, np.ndarray] = {}
    for j, (a, b) in enumerate(old_ranges):
        s, e = max(a, lo), min(b, hi)
        if e <= s:
            continue
        _, tensors = load_checkpoint(_vector_path(ckpt_root, j, tag))  # verified again: it may have changed
        for key, v in tensors.items():
            if key.startswith("vec."):
                out = parts.setdefault(key[4:], np.zeros(hi - lo, dtype=np.float32))
                out[s - lo : e - lo] = v[s - a : e - a].numpy()
    shard = ParameterShard(shard_id, lo, hi, parts.pop(PARAMS), None, total)
    for name, values in parts.items():
        shard.vectors[name] = torch.from_numpy(values)
    shard.restored_from_version = tag
    return shard


def tidy(ckpt_root: str | Path) -> None:
    """Delete what no kept state can use any more: shard directories beyond every kept state's shard count (left
    when a run resumed with fewer shards) and temporary files of writes a killed process never finished.
    Call it only when no checkpoint is being written."""
    d = vectors_root(ckpt_root)
    counts = []
    for p in d.glob("state-*.json"):
        try:
            counts.append(len(read_state(p)["shards"]))
        except CorruptState:
            return  # cannot tell what it needs: keep everything
    for tmp in [*d.glob(".state-*.tmp*"), *d.glob("shard-*/.ckpt-*.tmp*")]:
        tmp.unlink(missing_ok=True)
    if not counts:
        return
    for sd in d.glob("shard-*"):
        if sd.is_dir() and int(sd.name.split("-")[1]) >= max(counts):
            shutil.rmtree(sd, ignore_errors=True)
