"""Compressed pushes (distbelief/compression): bytes on the wire, exact error feedback, QSGD's unbiasedness, and
PowerSGD against torch's own powerSGD_hook."""

import math
import os
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from distbelief.compression import ErrorFeedback, make_codec, wire_bytes
from distbelief.compression.powersgd import tensor_layout
from distbelief.compression.qsgd import BUCKET
from distbelief.compression.topk import kept


class Net(nn.Module):
    """Matrices that straddle shard boundaries, a bias, and a matrix too small to compress."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(40, 64)
        self.b = nn.Linear(64, 30)
        self.c = nn.Linear(30, 3)


def layout(model, shards=3):
    n = sum(p.numel() for p in model.parameters())
    cuts = [round(n * k / shards) for k in range(shards + 1)]
    return n, list(zip(cuts[:-1], cuts[1:]))


def codecs(model, ranges):
    t = tensor_layout(model)
    return [make_codec("fp16", ranges), make_codec("topk", ranges, ratio=0.05),
            make_codec("qsgd", ranges, bits=4, seed=1), make_codec("qsgd", ranges, bits=2, seed=1),
            make_codec("qsgd", ranges, bits=8, seed=1), make_codec("powersgd", ranges, t, rank=4, seed=0),
            make_codec("powersgd", ranges, t, rank=2, seed=0)]


def gradients(model, steps=4, seed=0):
    """Real minibatch gradients of ``model`` (flat float32), a few steps of plain SGD apart."""
    torch.manual_seed(seed)
    out = []
    for _ in range(steps):
        model.zero_grad()
        x, y = torch.randn(32, 40), torch.randint(0, 3, (32,))
        nn.functional.cross_entropy(model.c(torch.relu(model.b(torch.relu(model.a(x))))), y).backward()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return out


def test_each_part_weighs_what_the_schemes_formula_says():
    model = Net()
    n, ranges = layout(model)
    for codec in codecs(model, ranges):
        parts = codec.encode(gradients(model, 1)[0])
        assert len(parts) == len(ranges)
        for k, part in enumerate(parts):
            assert wire_bytes(part) == codec.formula_bytes(k), (codec.describe(), k)


def _leaves(obj):
    if isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _leaves(x)
    else:
        yield obj


def test_every_part_travels_as_numpy_arrays_and_numbers():
    """Ray sends a numpy array as an out-of-band buffer and a torch tensor through its pickled storage, several
    times dearer on both ends of every push: no scheme may put a tensor in a part."""
    model = Net()
    _, ranges = layout(model)
    for codec in codecs(model, ranges):
        for part in codec.encode(gradients(model, 1)[0]):
            kinds = {type(x) for x in _leaves(part)}
            assert kinds <= {np.ndarray, int, float}, (codec.describe(), kinds)


def test_the_formulas_are_the_schemes_arithmetic():
    ranges = [(0, 1000), (1000, 2500)]
    assert make_codec("fp16", ranges).formula_bytes(1) == 2 * 1500
    assert make_codec("topk", ranges, ratio=0.01).formula_bytes(0) == 8 * 10
    assert kept(0.01, 1500) == 15 and kept(0.001, 10) == 1
    # 4 bits per value, a float32 norm per bucket of 512, and the two ints that say how to unpack
    assert make_codec("qsgd", ranges, bits=4).formula_bytes(1) == 750 + 4 * math.ceil(1500 / BUCKET) + 8
    # one 100 x 20 matrix, rank 4, all in shard 0: P (100 x 4) and Q (20 x 4), three ints; a bias of 100 values
    t = [(0, (100, 20)), (2000, (100,))]
    c = make_codec("powersgd", [(0, 2000), (2000, 2100)], t, rank=4)
    assert c.formula_bytes(0) == 4 * 4 * (100 + 20) + 12 and c.formula_bytes(1) == 4 * 100 + 4


def test_sent_plus_new_residual_is_the_gradient_plus_old_residual_bit_for_bit():
    model = Net()
    n, ranges = layout(model)
    grads = gradients(model, 5)
    for codec in codecs(model, ranges):
        fb = ErrorFeedback(codec, n)
        for g in grads:
            old = fb.residual.clone()
            fb.compress(g)
            a = (g.double() + old).float().double()  # what was compressed: g + old residual, formed in float32
            assert torch.equal(fb.last_sent.double() + fb.residual, a), codec.describe()
        assert fb.residual.abs().sum() > 0 or codec.name == "fp16"  # the scheme did leave something out


def test_the_shards_decode_what_the_replica_believes_it_sent():
    """Each part travels pickled (as Ray sends it) and is decoded at its own range: the shards' values, put
    together, are the replica's ``sent`` bit for bit."""
    model = Net()
    n, ranges = layout(model)
    g = gradients(model, 1)[0]
    for codec in codecs(model, ranges):
        parts = codec.encode(g)
        sent = codec.sent(parts)
        for part, (lo, hi) in zip(parts, ranges):
            assert torch.equal(type(codec).decode(pickle.loads(pickle.dumps(part)), lo, hi), sent[lo:hi])


def test_powersgd_decodes_whole_matrices_in_place_with_the_same_bits():
    """A range holding whole rows of a matrix gets ``P Qᵀ`` written straight into its output; the values are the
    product's, bit for bit, as where a range cuts a row (both kinds of piece are here)."""
    model = Net()
    n, _ = layout(model)
    ranges = [(0, 2560), (2560, n)]  # shard 0: Linear(40, 64)'s weight exactly; shard 1 holds all of the next
    codec = make_codec("powersgd", ranges, tensor_layout(model), rank=4)
    parts = codec.encode(gradients(model, 1)[0])
    whole = 0
    for part, (lo, hi) in zip(parts, ranges):
        out = type(codec).decode(pickle.loads(pickle.dumps(part)), lo, hi)
        for piece in part:
            if len(piece) == 5:
                at, skip, count, p_rows, q = piece
                assert isinstance(p_rows, np.ndarray) and isinstance(q, np.ndarray)  # (Ray's cheap path)
                p_rows, q = torch.from_numpy(p_rows), torch.from_numpy(q)
                whole += skip == 0 and count == p_rows.shape[0] * q.shape[0]
                product = torch.bmm(p_rows[None], q.t()[None])[0].flatten()[skip:skip + count]
                assert torch.equal(out[at:at + count], product)
    assert whole == 2


def test_topk_keeps_the_largest_values_of_each_range():
    g = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, -0.3, 9.0, 0.05])
    codec = make_codec("topk", [(0, 4), (4, 8)], ratio=0.5)
    assert torch.equal(codec.sent(codec.encode(g)), torch.tensor([0.0, -5.0, 0.0, 3.0, 0.0, -0.3, 9.0, 0.0]))


def test_fp16_clamps_values_beyond_its_range_and_feedback_keeps_the_rest():
    g = torch.tensor([1e6, -1e6, 1.0 / 3.0])
    fb = ErrorFeedback(make_codec("fp16", [(0, 3)]), 3)
    fb.compress(g)
    assert fb.last_sent[0] == 65504.0 and fb.residual[0] == 1e6 - 65504.0
    third = torch.tensor(1.0 / 3.0)  # float32
    assert fb.residual[2] == float(third) - float(third.half())


def test_qsgd_is_unbiased():
    """The mean of many independent draws of QSGD's decoded vector is the vector: within 5 standard deviations of
    the mean of N draws, per value (a draw's variance is at most (norm / s)**2 / 4 per value)."""
    torch.manual_seed(3)
    x = torch.randn(1000) * torch.rand(1000)  # values of many sizes
    for bits in (2, 4):
        codec = make_codec("qsgd", [(0, 1000)], bits=bits, seed=5)
        draws = 4000
        total = torch.zeros(1000, dtype=torch.float64)
        for _ in range(draws):
            total += codec.sent(codec.encode(x)).double()
        mean = total / draws
        s = 2 ** (bits - 1) - 1
        norms = torch.stack([x[i:i + BUCKET].norm() for i in range(0, 1000, BUCKET)]).repeat_interleave(BUCKET)[:1000]
        bound = 5 * norms.double() / (2 * s * math.sqrt(draws))
        assert ((mean - x.double()).abs() <= bound).all(), bits
        assert codec.sent(codec.encode(x)).unique().numel() <= 2 * s + 1 + 2  # levels, per bucket's norm


_TORCH_POWERSGD = """
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel as DDP

from distbelief.baselines.processes import free_port

weights_and_grads, rank, start_iter = torch.load(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
w0 = weights_and_grads[0][0]
lin = nn.Linear(w0.shape[1], w0.shape[0], bias=False)
ddp = DDP(lin)
state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
                         min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
ddp.register_comm_hook(state, ps.powerSGD_hook)
out = []
for w, g in weights_and_grads:
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.weight.grad = None
    compressing = state.iter >= start_iter
    err = state.error_dict.get(0)
    err = torch.zeros(w.numel()) if err is None else err.clone()  # the hook starts from none
    x = torch.eye(w.shape[1])  # d(sum(W x * G'))/dW = G' x^T = G' with x = I: the gradient is g
    (ddp(x) * g.t()).sum().backward()
    out.append((lin.weight.grad.clone(), err if compressing else None))
torch.save(out, sys.argv[2])
os._exit(0)  # no teardown of the gloo group: its destructors have deadlocked and aborted in the past
"""


def _torch_powersgd(weights_and_grads, rank, start_iter=2):
    """torch's powerSGD_hook on a one-matrix model in a one-process gloo group: for each (weight, gradient), the
    gradient DDP hands the optimizer, and the error the hook held before it (its input is gradient + error).

    It runs in a process of its own: a gloo group torn down in the test process has deadlocked (its destructor
    on its own mutex) and aborted the whole suite in past runs."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        given, taken = Path(d) / "in.pt", Path(d) / "out.pt"
        torch.save((weights_and_grads, rank, start_iter), given)
        subprocess.run([sys.executable, "-c", _TORCH_POWERSGD, str(given), str(taken)], check=True, timeout=50,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return torch.load(taken)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [2, 4])
def test_powersgd_step_is_torchs_powersgd_hook_on_one_matrix(rank):
    torch.manual_seed(0)
    rows, cols = 48, 64
    steps = [(torch.randn(rows, cols), torch.randn(rows, cols)) for _ in range(5)]
    theirs = _torch_powersgd(steps, rank)
    codec = make_codec("powersgd", [(0, rows * cols)], [(0, (rows, cols))], rank=rank, seed=0)
    compressed = 0
    for (w, g), (grad, err) in zip(steps, theirs):
        if err is None:  # the hook's first start_powerSGD_iter steps: plain all-reduce, no compression
            assert torch.equal(grad, g)
            continue
        a = g.flatten() + err  # the hook's input: the gradient plus its error, in float32
        sent = codec.sent(codec.encode(a))
        assert torch.equal(sent.view(rows, cols), grad), f"step {compressed}"
        compressed += 1
    assert compressed == 3


@pytest.mark.parametrize("case", ["normal", "heavy-tailed", "mostly-zero", "ties", "sorted", "tiny"])
def test_topk_selection_keeps_the_k_largest_magnitudes(case):
    """``topk.largest`` (a sampled threshold, then a selection among the values above it) picks k positions,
    increasing and distinct, and no value it leaves is larger than one it keeps; without ties they are exactly
    the positions a full selection picks. The shapes cover its fallbacks: too few or too many candidates."""
    from distbelief.compression.topk import largest

    rng = np.random.default_rng(7)
    n = 5 if case == "tiny" else 200_000
    m = {"normal": lambda: rng.standard_normal(n),
         "heavy-tailed": lambda: rng.standard_cauchy(n),
         "mostly-zero": lambda: np.where(rng.random(n) < 0.995, 0.0, rng.standard_normal(n)),
         "ties": lambda: rng.integers(0, 4, n).astype(float),
         "sorted": lambda: np.sort(rng.standard_normal(n)),
         "tiny": lambda: rng.standard_normal(n)}[case]()
    m = np.abs(m).astype(np.float32)
    for k in (1, 3, max(1, n // 100), n // 2, n):
        idx = largest(m, k)
        assert idx.dtype == np.int32 and idx.size == k and (np.diff(idx) > 0).all()
        left = np.delete(m, idx)
        assert left.size == 0 or left.max() <= m[idx].min(), k
        if case in ("normal", "heavy-tailed", "sorted", "tiny"):  # no ties: the one answer
            assert np.array_equal(idx, np.sort(np.argpartition(m, n - k)[n - k:])), k
