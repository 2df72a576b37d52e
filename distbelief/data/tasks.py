"""Tasks shipped with distbelief, all generated offline and cached on disk as .npy files (no pickles).

- ``mnist1d``: the MNIST-1D benchmark (Greydanus 2020) from the ``mnist1d`` package's procedural generator.
- ``speech``: paper-shaped synthetic acoustic frames: 11 frames x 40 log-energies = 440 inputs, up to 8192
  classes. Inputs are temporally correlated Gaussian frames; labels are the argmax of a fixed random teacher
  network plus Gumbel noise, so the Bayes accuracy is below 100% and a student has to learn a non-linear rule.
  ``class_prior`` > 0 skews the class frequencies (Zipf), as real acoustic states are skewed.
- ``shapes``: synthetic 32x32 images of 8 shapes at random places (an offline image task for locally connected
  models, standing in for the paper's ImageNet).
- ``ctr``: Criteo-shaped synthetic click logs (13 dense features, 26 categorical fields with the Criteo Kaggle
  cardinalities capped at ``ctr_max_rows``) labelled by a planted teacher; ``Task.planted_auc`` is the best AUC
  any model can reach (data/ctr.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

TASKS = ("mnist1d", "speech", "shapes", "ctr")


@dataclass(frozen=True)
class TaskSpec:
    """Everything that determines a task's data; equal specs give identical data."""

    name: str = "mnist1d"
    num_samples: int = 10000  # train + test
    num_classes: int = 0  # speech only (0 = task default)
    seed: int = 0
    test_fraction: float = 0.2
    class_prior: float = 0.0  # speech only: Zipf exponent of the class frequencies (0 = balanced)
    ctr_max_rows: int = 0  # ctr only: cap on every categorical field's rows (0 = CTR_MAX_ROWS)

    def resolved(self) -> "TaskSpec":
        if self.name == "ctr":
            from distbelief.data.ctr import CTR_MAX_ROWS

            return replace(self, num_classes=2, class_prior=0.0, ctr_max_rows=self.ctr_max_rows or CTR_MAX_ROWS)
        if self.ctr_max_rows:  # not read by the other tasks: keep their cache keys
            return replace(self, ctr_max_rows=0).resolved()
        if self.name == "speech" and self.num_classes == 0:
            # RunConfig.validate() has already chosen the model's count (8192 for speech-paper); a bare spec
            # gets the small models' default.
            from distbelief.defaults import SPEECH_CLASSES

            return TaskSpec(self.name, self.num_samples, SPEECH_CLASSES, self.seed, self.test_fraction,
                            self.class_prior)
        if self.name == "mnist1d":
            return TaskSpec(self.name, self.num_samples, 10, self.seed, self.test_fraction)
        if self.name == "shapes":
            return TaskSpec(self.name, self.num_samples, len(SHAPES), self.seed, self.test_fraction)
        return self


@dataclass
class Task:
    spec: TaskSpec
    train: TensorDataset
    test: TensorDataset
    input_shape: tuple[int, ...]
    num_classes: int
    # ctr only: the row count of every categorical field (what dlrm-small's tables need), and the AUC of the
    # teacher's true click probabilities on the test set (the best any model can reach)
    cardinalities: tuple[int, ...] | None = None
    planted_auc: float | None = None


def cache_dir() -> Path:
    d = Path(os.environ.get("DISTBELIEF_CACHE", Path.home() / ".cache" / "distbelief"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _key(spec: TaskSpec) -> str:
    fields = asdict(spec)
    for name in ("class_prior", "ctr_max_rows"):  # unset: the key (and cache entry) of specs made before the field
        if not fields[name]:
            del fields[name]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _cached(spec: TaskSpec, make, with_meta: bool = False) -> dict:
    """The task's arrays from the cache, made by ``make(spec)`` first if needed. ``with_meta``: ``make`` also
    returns a JSON-able ``"meta"`` dict (kept as ``meta.json`` next to the arrays, and returned under "meta")."""
    path = cache_dir() / f"{spec.name}-{_key(spec)}"
    names = ("x", "y", "x_test", "y_test")

    def load() -> dict:
        out = {n: np.load(path / f"{n}.npy", mmap_mode="r", allow_pickle=False) for n in names}
        if with_meta:
            out["meta"] = json.loads((path / "meta.json").read_text())
        return out

    if all((path / f"{n}.npy").exists() for n in names) and (not with_meta or (path / "meta.json").exists()):
        try:
            return load()
        except (ValueError, OSError):
            pass  # a torn cache entry: rebuild it below
    arrays = make(spec)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for n in names:
        np.save(tmp / f"{n}.npy", np.ascontiguousarray(arrays[n]), allow_pickle=False)
    if with_meta:
        (tmp / "meta.json").write_text(json.dumps(arrays["meta"], indent=2) + "\n")
    try:
        os.rename(tmp, path)  # atomic publish; a concurrent builder may have won the race
    except OSError:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return load()


def _make_mnist1d(spec: TaskSpec) -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = spec.num_samples
    args.seed = spec.seed
    args.train_split = 1.0 - spec.test_fraction
    d = make_dataset(args)
    return {
        "x": d["x"].astype(np.float32),
        "y": d["y"].astype(np.int64),
        "x_test": d["x_test"].astype(np.float32),
        "y_test": d["y_test"].astype(np.int64),
    }


SPEECH_FRAMES, SPEECH_BANDS = 11, 40


def _make_speech(spec: TaskSpec) -> dict[str, np.ndarray]:
    """Synthetic frames labelled by a random teacher. Generated in chunks to bound memory."""
    g = torch.Generator().manual_seed(spec.seed)
    d_in, hidden, classes = SPEECH_FRAMES * SPEECH_BANDS, 256, spec.num_classes
    w1 = torch.randn(d_in, hidden, generator=g) / d_in**0.5
    w2 = torch.randn(hidden, hidden, generator=g) / hidden**0.5
    w3 = torch.randn(hidden, classes, generator=g) / hidden**0.5

    def frames(n: int) -> torch.Tensor:
        # AR(1) over the 11 frames: neighbouring frames are correlated, as in real spectrograms.
        x = torch.empty(n, SPEECH_FRAMES, SPEECH_BANDS)
        x[:, 0] = torch.randn(n, SPEECH_BANDS, generator=g)
        for t in range(1, SPEECH_FRAMES):
            x[:, t] = 0.8 * x[:, t - 1] + 0.6 * torch.randn(n, SPEECH_BANDS, generator=g)
        return x.reshape(n, d_in)

    def logits(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ w1) @ w2) @ w3

    # Balance the classes: centre and scale each teacher logit on a calibration sample.
    calib = logits(frames(4096))
    mu, sd = calib.mean(0), calib.std(0) + 1e-6
    # Optionally skew them again on purpose, as real acoustic states are: class k gets log-prior -s*log(k+1)
    # (Zipf), so a few states are frequent and most are rare — the regime where Adagrad's per-parameter rates
    # matter (the rare classes' output weights get large steps).
    log_prior = -spec.class_prior * torch.log(torch.arange(1, classes + 1, dtype=torch.float32))
    xs, ys = [], []
    for start in range(0, spec.num_samples, 8192):
        n = min(8192, spec.num_samples - start)
        x = frames(n)
        z = (logits(x) - mu) / sd
        gumbel = -torch.log(-torch.log(torch.rand(n, classes, generator=g).clamp_min(1e-12)))
        ys.append(torch.argmax(3.0 * z + log_prior + gumbel, dim=1))
        xs.append(x)
    x, y = torch.cat(xs).numpy().astype(np.float32), torch.cat(ys).numpy().astype(np.int64)
    split = int(round(spec.num_samples * (1.0 - spec.test_fraction)))
    return {"x": x[:split], "y": y[:split], "x_test": x[split:], "y_test": y[split:]}


SHAPES = ("disk", "square", "ring", "cross", "triangle", "diamond", "hbar", "vbar")
SHAPES_SIZE = 32


def _make_shapes(spec: TaskSpec) -> dict[str, np.ndarray]:
    """32x32 one-channel images of one of 8 shapes at a random place, size and brightness, on a noisy random
    gradient background. Position varies, so a locally connected model must learn each shape at every place —
    the reason the paper's image model has so many (untied) parameters."""
    rng = np.random.default_rng(spec.seed)
    n, S = spec.num_samples, SHAPES_SIZE
    yy, xx = np.mgrid[0:S, 0:S].astype(np.float32)
    x = np.empty((n, 1, S, S), dtype=np.float32)
    y = rng.integers(0, len(SHAPES), n)
    for start in range(0, n, 4096):
        m = min(4096, n - start)
        cy, cx = (rng.uniform(9, S - 9, (m, 1, 1)).astype(np.float32) for _ in range(2))
        r = rng.uniform(4.5, 8.0, (m, 1, 1)).astype(np.float32)
        dy, dx = yy - cy, xx - cx
        dist = np.sqrt(dx * dx + dy * dy)
        masks = np.stack([
            dist <= r,
            np.maximum(np.abs(dx), np.abs(dy)) <= 0.8 * r,
            np.abs(dist - r) <= 1.2,
            ((np.abs(dx) <= 1.2) & (np.abs(dy) <= r)) | ((np.abs(dy) <= 1.2) & (np.abs(dx) <= r)),
            (dy <= 0.8 * r) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.55),
            np.abs(dx) + np.abs(dy) <= r,
            (np.abs(dy) <= 1.5) & (np.abs(dx) <= r),
            (np.abs(dx) <= 1.5) & (np.abs(dy) <= r),
        ])  # (shapes, m, S, S)
        mask = masks[y[start:start + m], np.arange(m)].astype(np.float32)
        bright = rng.uniform(0.6, 1.4, (m, 1, 1)).astype(np.float32)
        gy, gx = (rng.normal(0, 0.02, (m, 1, 1)).astype(np.float32) for _ in range(2))
        background = gy * (yy - S / 2) + gx * (xx - S / 2)
        noise = rng.normal(0, 0.25, (m, S, S)).astype(np.float32)
        x[start:start + m, 0] = mask * bright + background + noise
    split = int(round(n * (1.0 - spec.test_fraction)))
    y = y.astype(np.int64)
    return {"x": x[:split], "y": y[:split], "x_test": x[split:], "y_test": y[split:]}


def _make_ctr(spec: TaskSpec) -> dict:
    from distbelief.data.ctr import make_ctr

    return make_ctr(spec.num_samples, spec.ctr_max_rows, spec.seed, spec.test_fraction)


_MAKERS = {"mnist1d": _make_mnist1d, "speech": _make_speech, "shapes": _make_shapes, "ctr": _make_ctr}


def load_task(spec: TaskSpec) -> Task:
    """Generate (first time) or load from the cache the task's train and test sets."""
    spec = spec.resolved()
    if spec.name not in _MAKERS:
        raise ValueError(f"unknown task {spec.name!r}; choose one of {', '.join(TASKS)}")
    ctr = spec.name == "ctr"
    a = _cached(spec, _MAKERS[spec.name], with_meta=ctr)
    # torch.from_numpy on a read-only mmap would warn; the copy is cheap next to training.
    train = TensorDataset(torch.from_numpy(np.array(a["x"])), torch.from_numpy(np.array(a["y"])))
    test = TensorDataset(torch.from_numpy(np.array(a["x_test"])), torch.from_numpy(np.array(a["y_test"])))
    meta = a.get("meta", {})
    cardinalities = tuple(meta["cardinalities"]) if ctr else None
    return Task(spec, train, test, tuple(train.tensors[0].shape[1:]), spec.num_classes, cardinalities,
                meta.get("planted_auc"))


def load_train(spec: TaskSpec) -> TensorDataset:
    """Picklable dataset factory for workers: each process loads the cached data itself."""
    return load_task(spec).train
