"""Settings whose good value depends on other settings: resolved by ``RunConfig.validate()`` from None ("auto",
the default; 0 is refused, never read as the default).

Why a table and not one number: the shipped models differ by orders of magnitude in how large a step they take.
The paper's speech model has four sigmoid layers of 2560 units; an Adagrad step of γ = 0.05 moves every one of
its 6.5M first-layer weights by ±0.05 at once and saturates every unit, where the 256-unit mnist1d MLP is happy
with it. Every rate below was measured to train (see ``RECOMMENDED_LR``); a run that still diverges stops with
a DivergedError that names ``--lr``.
"""

from __future__ import annotations

from distbelief.exceptions import ConfigError

# ---------------------------------------------------------------- classes of the speech task
SPEECH_CLASSES = 256  # the small speech models' default: quick to train on one machine
PAPER_SPEECH_CLASSES = 8192  # the paper's output layer: 440-2560x4-8192, about 42M parameters


def default_num_classes(task: str, model: str) -> int | None:
    """The class count of ``task`` for ``model`` when the user gave none: the paper's model gets the paper's
    8192 outputs (it *is* 440-2560x4-8192), the other speech models 256. Other tasks have a fixed count that
    the data decides (None stays None: a custom dataset passed to ``train()`` has no task class count)."""
    if task == "speech":
        return PAPER_SPEECH_CLASSES if model == "speech-paper" else SPEECH_CLASSES
    return None


# ---------------------------------------------------------------- examples generated for a task
NUM_SAMPLES = 40000  # train + test of the small tasks: generated in a second or two
# ctr: 800k training examples, so that a minute of training is about one pass. The task's rare ids are
# memorised from the second pass on (the test AUC falls; data/ctr.py), as on the real Criteo logs, where one
# pass is the norm. Generated in about 4 s.
CTR_NUM_SAMPLES = 1_000_000


def default_num_samples(task: str) -> int:
    """The examples (train + test) that an unset ``num_samples`` means for ``task``."""
    return CTR_NUM_SAMPLES if task == "ctr" else NUM_SAMPLES


# ---------------------------------------------------------------- learning rate
# (model, update rule) -> the rate. The update rule is the server optimizer: the shards' rule for sync and
# downpour, torch.optim's for sgd, hogwild and ddp. Chosen from short sweeps (torch.optim, batch 32, seed 0;
# 128 for speech-paper) on the model's task: the best or, where async replicas add up their steps, the next
# smaller rate that trained. mnist1d (500 steps, test loss): every model trains at Adagrad 0.05 and SGD 0.2
# (cnn at SGD 1.0 stuck at chance). speech, 256 classes (300 steps): Adagrad 0.05 explodes speech-small (train
# loss 24 after 60 steps), 0.005 trains it; speech-paper (8192 classes, 25 steps): Adagrad 0.001-0.002 and
# SGD <= 0.05 lower the loss, SGD 0.2 raises it. Wider sigmoid layers need smaller rates: an Adagrad step moves
# every weight by about gamma, a logit by about gamma x (units x 0.5). speech-medium and lc-image-* are
# interpolated, not swept. dlrm-small (ctr, batch 256, best test AUC in one pass of 800k examples, planted
# 0.814): Adagrad 0.05 0.8087, 0.03 0.8084 (later in the pass); its SGD rate is not swept.
RECOMMENDED_LR: dict[tuple[str, str], float] = {
    ("mlp", "adagrad"): 0.05, ("mlp", "sgd"): 0.2,
    ("mlp-small", "adagrad"): 0.05, ("mlp-small", "sgd"): 0.2,
    ("cnn", "adagrad"): 0.05, ("cnn", "sgd"): 0.2,
    ("lc1d", "adagrad"): 0.05, ("lc1d", "sgd"): 0.2,
    ("lc-image-small", "adagrad"): 0.02, ("lc-image-small", "sgd"): 0.1,
    ("lc-image-medium", "adagrad"): 0.02, ("lc-image-medium", "sgd"): 0.1,
    ("speech-tiny", "adagrad"): 0.02, ("speech-tiny", "sgd"): 0.5,
    ("speech-small", "adagrad"): 0.005, ("speech-small", "sgd"): 0.5,
    ("speech-medium", "adagrad"): 0.002, ("speech-medium", "sgd"): 0.2,
    ("speech-paper", "adagrad"): 0.001, ("speech-paper", "sgd"): 0.05,
    ("dlrm-small", "adagrad"): 0.05, ("dlrm-small", "sgd"): 0.05,
}
FALLBACK_LR = {"adagrad": 0.01, "sgd": 0.05}  # a model not in the table (none shipped today)
# Rules that take the rate of another: row-wise Adagrad's step on a row is about lr, as Adagrad's on a float.
SAME_LR_AS = {"rowwise-adagrad": "adagrad"}


def recommended_lr(model: str, strategy: str, optimizer: str) -> float:
    """The rate that an unset ``lr`` means for this model and update rule. Sandblaster's L-BFGS takes no rate (its
    line search chooses every step), so it gets the rule's rate only to have a number in config.toml.

    Raises:
        ConfigError: ``lr``, for a rule with no measured rate (set one).
    """
    optimizer = SAME_LR_AS.get(optimizer, optimizer)
    if optimizer not in FALLBACK_LR:
        raise ConfigError("lr", f"no recommended rate for optimizer {optimizer!r}; set lr > 0")
    return RECOMMENDED_LR.get((model, optimizer), FALLBACK_LR[optimizer])


# ---------------------------------------------------------------- sandblaster's batch and portions
MINIBATCH = 32  # examples per replica step for the SGD-family strategies
# Models whose step costs too much per example at 32: dlrm-small's step touches 26 tables (a sparse update each),
# which at 256 examples costs about 3x what it costs at 32 (8x the examples/s; data/ctr.py's tuning).
MODEL_MINIBATCH = {"dlrm-small": 256}


def default_batch_size(model: str) -> int:
    """The minibatch that an unset ``batch_size`` means for ``model``."""
    return MODEL_MINIBATCH.get(model, MINIBATCH)
# lbfgs_batch unset: examples per L-BFGS iteration. Thousands: 32 would give a noisy gradient and a useless
# curvature estimate.
SANDBLASTER_BATCH = 8000
SANDBLASTER_PORTIONS_PER_BATCH = 16  # portion = batch / 16: room for load balancing and backup tasks


UNUSED_PORTION = 64  # the other strategies have no portions; a fixed number keeps their config.toml stable


def default_portion_size(strategy: str, lbfgs_batch: int) -> int:
    """``portion_size`` unset: for Sandblaster a sixteenth of the L-BFGS batch (at least 1): small enough to balance the
    replicas and leave room for backup tasks, large enough that a portion's round trip does not dominate its
    compute. The other strategies do not use it."""
    if strategy != "sandblaster":
        return UNUSED_PORTION
    return max(1, lbfgs_batch // SANDBLASTER_PORTIONS_PER_BATCH)
