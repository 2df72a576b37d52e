"""``ctr``: Criteo-shaped synthetic click logs with a planted teacher, generated offline (no download).

Each example is one ad impression: 13 dense count features and 26 categorical fields, laid out as one float32
row ``x`` of 13 + 26 values (the model splits it: ``x[:, :13]`` dense, ``x[:, 13:]`` the ids), and a click label
``y`` in {0, 1} (float32).

- Dense features: log-normal counts (correlated), stored as ``(log1p(count) - mean) / std`` with the mean and
  standard deviation of the training split, i.e. ready for the model (the usual Criteo pre-processing).
- Categorical fields: the 26 cardinalities of the Criteo Kaggle (Display Advertising Challenge) data, each capped
  at ``max_rows`` (as a frequency cut-off would). Ids are ranked by frequency, like a frequency-sorted
  vocabulary: id 0 is the field's most frequent value, and id r has probability ~ 1/(r+1)^a (Zipf, a per field).
  Ids are exact integers stored in float32 (every capped cardinality is < 2^24).
- Labels: y ~ Bernoulli(sigmoid(teacher logit)). The teacher is a model ``dlrm-small`` can represent: a scalar
  effect per row of every field, a small tanh network of the dense features, and dot products of per-row
  vectors for a few field pairs, plus a bias calibrated to a positive rate of 25.6 % (Criteo's). A row's effect
  shrinks with its rarity (it is ``p / (p + P_HALF)`` of full size for a row of probability ``p``): frequent
  ids and the dense features carry most of the signal, ids seen a handful of times carry little, so a short run
  can learn most of what there is to learn.

The best AUC any model can reach is that of the true probabilities: ``planted_auc``, the AUC of ``p`` on the
test set, computed here and stored with the data (``meta.json`` next to the cached arrays).
"""

from __future__ import annotations

import numpy as np

# The Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical fields C1..C26.
CRITEO_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
NUM_DENSE, NUM_SPARSE = 13, len(CRITEO_CARDINALITIES)
CTR_MAX_ROWS = 200_000  # default cap: 1.48M rows, 23.7M parameters in dlrm-small's tables at dimension 16
MAX_EXACT_ID = 2**24  # float32 holds every integer up to 2^24 exactly
POSITIVE_RATE = 0.256  # Criteo Kaggle's click rate

# The teacher. Variance shares of its logit (before the bias) and its total standard deviation. Tuned (with
# P_HALF and the Zipf exponents below) so that one pass of dlrm-small with Adagrad (lr 0.05, batch 256) reaches
# a test AUC within about 0.005 of the planted AUC (0.814), and Criteo's order of AUC.
LOGIT_STD = 1.5
SHARE_FIELDS, SHARE_DENSE, SHARE_PAIRS = 0.5, 0.3, 0.2
PAIRS = ((0, 1), (5, 8), (6, 12), (3, 10))  # interacting fields (C1 x C2, ...), as user x ad interactions
PAIR_DIM = 4
DENSE_HIDDEN = 8
# A row of probability p has p / (p + P_HALF) of its full effect: half at 1 % of the field's examples (8,000
# occurrences in the default 800k training examples), a tenth at 0.1 %, almost nothing for the long tail.
P_HALF = 1e-2
# Zipf exponents of the fields, drawn in this range: most examples hold ids seen thousands of times, as in
# Criteo, and few hold ids rare enough to be memorised (each field's ids seen < 5 times in 800k: about 1 %).
ZIPF_LOW, ZIPF_HIGH = 1.3, 2.0


def capped_cardinalities(max_rows: int) -> tuple[int, ...]:
    """The 26 fields' row counts with the cap ``max_rows`` applied."""
    return tuple(min(c, max_rows) for c in CRITEO_CARDINALITIES)


def _zipf(rows: int, a: float) -> np.ndarray:
    p = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** a
    return p / p.sum()


def _teacher(rng: np.random.Generator, rows: tuple[int, ...]) -> dict:
    """The planted model (drawn from ``rng`` independently of the number of examples)."""
    exponents = rng.uniform(ZIPF_LOW, ZIPF_HIGH, NUM_SPARSE)
    probs = [_zipf(n, a) for n, a in zip(rows, exponents)]
    shrink = [p / (p + P_HALF) for p in probs]
    field_scale = rng.uniform(0.5, 1.5, NUM_SPARSE)
    effects = [(s * rng.standard_normal(len(p)) * w).astype(np.float32)
               for s, p, w in zip(field_scale, probs, shrink)]
    pairs = [((rng.standard_normal((rows[f], PAIR_DIM)) * shrink[f][:, None]).astype(np.float32),
              (rng.standard_normal((rows[g], PAIR_DIM)) * shrink[g][:, None]).astype(np.float32))
             for f, g in PAIRS]
    mu = rng.uniform(0.0, 4.0, NUM_DENSE)  # log-normal counts: log(count) ~ N(mu, sigma)
    sigma = rng.uniform(0.5, 1.5, NUM_DENSE)
    mix = rng.standard_normal((NUM_DENSE, NUM_DENSE)) * 0.4 + np.eye(NUM_DENSE)
    mix /= np.linalg.norm(mix, axis=1, keepdims=True)  # correlated standard normals, unit variance
    w1 = rng.standard_normal((NUM_DENSE, DENSE_HIDDEN)) / np.sqrt(NUM_DENSE) * 1.5
    b1 = rng.standard_normal(DENSE_HIDDEN) * 0.5
    w2 = rng.standard_normal(DENSE_HIDDEN)
    return dict(cdfs=[np.cumsum(p) for p in probs], effects=effects, pairs=pairs, mu=mu, sigma=sigma, mix=mix,
                w1=w1, b1=b1, w2=w2)


def _sample(rng: np.random.Generator, t: dict, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` impressions: ``(ids [n, 26] int64, log1p counts [n, 13])``."""
    ids = np.empty((n, NUM_SPARSE), dtype=np.int64)
    for f, cdf in enumerate(t["cdfs"]):
        ids[:, f] = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), len(cdf) - 1)
    g = rng.standard_normal((n, NUM_DENSE)) @ t["mix"].T
    counts = np.floor(np.exp(t["mu"] + t["sigma"] * g))  # integer counts, many small ones
    return ids, np.log1p(counts)


def _logit_parts(t: dict, ids: np.ndarray, dense_std: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The teacher's three parts (fields, dense, pairs), each [n], before scaling."""
    fields = sum(t["effects"][f][ids[:, f]].astype(np.float64) for f in range(NUM_SPARSE))
    dense = np.tanh(dense_std @ t["w1"] + t["b1"]) @ t["w2"]
    pairs = sum(np.einsum("nd,nd->n", u[ids[:, f]], v[ids[:, g]], dtype=np.float64)
                for (f, g), (u, v) in zip(PAIRS, t["pairs"]))
    return fields, dense, pairs


def _calibrated_bias(logit: np.ndarray, rate: float) -> float:
    """The bias b with mean(sigmoid(logit + b)) = rate (bisection; the mean is increasing in b)."""
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if np.mean(1.0 / (1.0 + np.exp(-(logit + mid)))) < rate:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def make_ctr(num_samples: int, max_rows: int, seed: int, test_fraction: float) -> dict:
    """Generate the task: ``{"x", "y", "x_test", "y_test"}`` float32 arrays, ``"meta"`` (a JSON-able dict with
    ``planted_auc``, ``cardinalities``, ``positive_rate``, ...) and ``"p_test"``, the teacher's click probability
    of every test example. Deterministic per argument set; the teacher
    depends on ``seed`` and ``max_rows`` only, not on ``num_samples``."""
    from distbelief.metrics.ctr import auc

    if not 1 <= max_rows <= MAX_EXACT_ID:
        raise ValueError(f"ctr_max_rows must be in [1, 2^24 = {MAX_EXACT_ID}] (ids are stored exactly in "
                         f"float32), got {max_rows}")
    rows = capped_cardinalities(max_rows)
    t = _teacher(np.random.default_rng([seed, 0]), rows)
    rng = np.random.default_rng([seed, 1])
    ids, logcounts = _sample(rng, t, num_samples)
    split = round(num_samples * (1.0 - test_fraction))
    mean, std = logcounts[:split].mean(0), logcounts[:split].std(0) + 1e-6
    dense = (logcounts - mean) / std
    # Scale each part to its share of the logit's variance, measured on the examples themselves.
    parts = _logit_parts(t, ids, dense)
    shares = (SHARE_FIELDS, SHARE_DENSE, SHARE_PAIRS)
    logit = sum(part * (LOGIT_STD * np.sqrt(share) / (part.std() + 1e-12)) for part, share in zip(parts, shares))
    logit = logit + _calibrated_bias(logit, POSITIVE_RATE)
    p = 1.0 / (1.0 + np.exp(-logit))
    y = (rng.random(num_samples) < p).astype(np.float32)
    x = np.concatenate([dense, ids], axis=1).astype(np.float32)  # ids < 2^24: exact in float32
    # None where the test set lacks a class (a tiny test set): the AUC is undefined there
    planted = auc(p[split:], y[split:]) if 0 < y[split:].sum() < num_samples - split else None
    meta = {
        "planted_auc": planted,
        "cardinalities": list(rows),
        "positive_rate": float(y.mean()),
        "planted_logloss": float(-np.mean(y[split:] * np.log(p[split:]) + (1 - y[split:]) * np.log1p(-p[split:])))
        if split < num_samples else None,
        "dense": "log1p(count), standardised with the training split's mean and std",
    }
    return {"x": x[:split], "y": y[:split], "x_test": x[split:], "y_test": y[split:], "meta": meta,
            "p_test": p[split:].astype(np.float32)}  # p_test: for checks, not cached
