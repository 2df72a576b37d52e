"""The calibration's fits (distbelief/simulate/calibrate.py): planted coefficients come back exactly from the
times they imply, and inputs that cannot fix them are refused with an error that says why."""

import numpy as np
import pytest

from distbelief.simulate.calibrate import (
    KINDS,
    STEP_BATCHES,
    StepPoint,
    fit_object_cpu,
    fit_steps,
    fit_transfers,
    least_squares,
    median_time,
    step_seconds,
    thread_efficiency,
)
from distbelief.simulate.profile import profile_model

# The multiply-adds per example of the calibration's own models (profile_model builds them on the meta device)
MODELS = {name: profile_model(name, task, classes).macs for name, task, classes in (
    ("speech-tiny", "speech", 8192), ("speech-small", "speech", 256), ("mlp", "mnist1d", 10),
    ("lc-image-small", "shapes", 8), ("cnn", "mnist1d", 10))}
PLANTED = (1.5e-3, 2e-6, {"dense": 4.2e10, "local": 1.7e9, "other": 2.3e10, "elementwise": 3.1e8})


def planted_points(step_s, example_s, rates, models=MODELS, batches=STEP_BATCHES):
    """The step of each model at each batch size, timed exactly as the planted costs say."""
    unknown = [StepPoint(b, dict(macs), float("nan")) for macs in models.values() for b in batches]
    return [StepPoint(p.batch, p.macs, step_seconds(step_s, example_s, rates, p)) for p in unknown]


def test_least_squares_recovers_planted_coefficients():
    rng = np.random.default_rng(0)
    rows = rng.uniform(0.1, 10.0, size=(12, 4))
    x = np.array([3e-3, 2e-2, 5e-7, 1.0])
    got = least_squares(rows, rows @ x, ["a", "b", "c", "d"])
    assert got == pytest.approx(dict(zip("abcd", x, strict=True)), rel=1e-9)


def test_fit_steps_recovers_planted_costs_from_the_calibration_models():
    step_s, example_s, rates = fit_steps(planted_points(*PLANTED))
    assert step_s == pytest.approx(PLANTED[0], rel=1e-9)
    assert example_s == pytest.approx(PLANTED[1], rel=1e-9)
    assert rates == pytest.approx(PLANTED[2], rel=1e-9)


@pytest.mark.parametrize("step_s, example_s", [(0.0, 2e-6), (1.5e-3, 0.0), (0.0, 0.0)])
def test_fit_steps_recovers_a_planted_zero_without_going_negative(step_s, example_s):
    got_step, got_example, rates = fit_steps(planted_points(step_s, example_s, PLANTED[2]))
    assert got_step >= 0 and got_example >= 0
    assert got_step == pytest.approx(step_s, abs=1e-12) and got_example == pytest.approx(example_s, abs=1e-15)
    assert rates == pytest.approx(PLANTED[2], rel=1e-6)


def test_fit_steps_holds_at_zero_a_per_example_cost_that_would_be_negative():
    """Times whose best fit has a negative per-example cost (here planted; noise does it to real ones): it is
    held at 0 and the rest is what fitting without it gives, every rate finite and positive."""
    points = planted_points(PLANTED[0], -1e-6, PLANTED[2])
    step_s, example_s, rates = fit_steps(points)
    rows = [[1.0, *(3.0 * p.batch * p.macs.get(k, 0.0) for k in KINDS)] for p in points]
    without = least_squares(rows, [p.seconds for p in points], ["step_s", *KINDS])
    assert example_s == 0.0
    assert step_s == pytest.approx(without["step_s"], rel=1e-9)
    assert rates == pytest.approx({k: 1.0 / without[k] for k in KINDS}, rel=1e-9)
    assert all(np.isfinite(r) and r > 0 for r in rates.values())


def test_step_seconds_is_the_simulators_formula():
    p = StepPoint(32, {"dense": 1e6, "local": 2e5, "other": 0.0}, 0.0)
    rates = {"dense": 1e10, "local": 1e9, "other": 5e9}
    expected = 1e-3 + 32 * (1e-6 + 3 * (1e6 / 1e10 + 2e5 / 1e9))
    assert step_seconds(1e-3, 1e-6, rates, p) == pytest.approx(expected)


@pytest.mark.parametrize("threads, efficiency", [(2, 0.8), (2, 0.0), (2, 1.0), (4, 0.55)])
def test_thread_efficiency_recovers_the_planted_share(threads, efficiency):
    fixed, macs = 2e-3, 60e-3  # the step's fixed part, and its multiply-adds on one thread
    many = fixed + macs / (1 + (threads - 1) * efficiency)
    assert thread_efficiency(fixed + macs, many, threads, fixed) == pytest.approx(efficiency, abs=1e-12)


def test_thread_efficiency_stays_within_zero_and_one():
    assert thread_efficiency(0.10, 0.04, 2, 0.0) == 1.0  # faster than two threads can be: caches, noise
    assert thread_efficiency(0.10, 0.12, 2, 0.0) == 0.0  # slower with a second thread: a busy machine


def test_thread_efficiency_refuses_what_cannot_tell_it():
    with pytest.raises(ValueError, match="2 threads or more"):
        thread_efficiency(0.1, 0.1, 1, 0.0)
    with pytest.raises(ValueError, match="longer than their fixed part"):
        thread_efficiency(0.1, 0.05, 2, 0.06)


def test_fit_transfers_recovers_planted_call_and_rate():
    call_s, rate = 2.5e-3, 8e8
    points = [(b, call_s + b / rate) for b in (200_000, 2**20, 8 * 2**20)]
    assert fit_transfers(points) == pytest.approx((call_s, rate), rel=1e-9)


def test_fit_transfers_with_times_that_fall_with_size_gives_no_fixed_cost():
    call_s, rate = fit_transfers([(1e6, 0.010), (8e6, 0.009)])
    assert call_s == 0.0 and rate > 0


def test_fit_object_cpu_recovers_planted_costs_from_whole_calls():
    call, obj, per_byte = 1.4e-3, 0.1e-3, 1.2e-9
    points = [(64, call)] + [(b, call + obj + b * per_byte) for b in (240_000, 4 * 2**20)]
    object_s, rate = fit_object_cpu(points)
    assert object_s == pytest.approx(obj, rel=1e-6) and 1 / rate == pytest.approx(per_byte, rel=1e-6)


def test_fit_object_cpu_takes_its_rate_from_the_large_reply_when_the_small_one_is_noise():
    """A calibration's three calls: the 0.24 MB reply cost less CPU than the tiny call (noise), the 4 MiB one
    6.5 ms more. Fitted to the differences in relative error, the clipped small one gave 4e-15 s a byte."""
    object_s, rate = fit_object_cpu([(64, 1.89e-3), (240_000, 1.51e-3), (4_194_304, 8.37e-3)])
    assert object_s == 0.0 and 1.0e-9 < 1 / rate < 2.0e-9


def test_fit_object_cpu_of_replies_no_dearer_than_a_tiny_call_is_free_not_an_error():
    """A noisy quick calibration can time a 4 MiB reply below the tiny call: the object store then costs
    nothing more, rather than the calibration failing (the old fit of the differences never failed)."""
    object_s, rate = fit_object_cpu([(64, 1.5e-3), (240_000, 1.6e-3), (4_194_304, 1.4e-3)])
    assert object_s >= 0 and 1 / rate == 0.0


# ------------------------------------------------------------------------------------------ degenerate inputs


def test_one_batch_size_cannot_tell_the_per_example_cost_from_the_per_step_one():
    with pytest.raises(ValueError, match="cannot tell example_s from step_s"):
        fit_steps(planted_points(*PLANTED, batches=(32, 32)))  # as many points, but one batch size


def test_a_kind_no_model_has_is_named():
    dense_only = {k: v for k, v in MODELS.items() if k.startswith("speech")}
    with pytest.raises(ValueError, match="no measurement exercises local"):
        fit_steps(planted_points(*PLANTED, models=dense_only, batches=(32, 64, 128)))


def test_too_few_measurements_are_refused():
    with pytest.raises(ValueError, match="5 measurements cannot fix 6 coefficients"):
        fit_steps(planted_points(*PLANTED, batches=(32,)))
    with pytest.raises(ValueError, match="1 measurements cannot fix 2 coefficients"):
        fit_transfers([(1e6, 0.01)])
    with pytest.raises(ValueError, match="cannot tell s_per_byte from call_s"):
        fit_transfers([(1e6, 0.01), (1e6, 0.012)])


@pytest.mark.parametrize("bad", [0.0, -1e-3, float("nan"), float("inf")])
def test_times_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_transfers([(1e6, 0.01), (8e6, bad)])


def test_rows_and_times_must_match():
    with pytest.raises(ValueError, match="one row of 2 values"):
        least_squares([[1.0, 2.0], [1.0, 3.0]], [1.0], ["a", "b"])
    with pytest.raises(ValueError, match="one row of 2 values"):
        least_squares([[1.0, 2.0, 3.0], [1.0, 3.0, 4.0]], [1.0, 2.0], ["a", "b"])
    with pytest.raises(ValueError, match="may_be_zero names c"):
        least_squares([[1.0, 2.0], [1.0, 3.0]], [1.0, 2.0], ["a", "b"], may_be_zero=("c",))


def test_no_fit_with_positive_coefficients_is_an_error():
    # 2 = a + b, 1 = a + 2b: b = -1, and nothing may be held at 0
    with pytest.raises(ValueError, match="no fit of a, b with positive coefficients"):
        least_squares([[1.0, 1.0], [1.0, 2.0]], [2.0, 1.0], ["a", "b"])


def test_median_time_runs_the_warmup_untimed_then_the_repeats():
    calls = []
    assert median_time(lambda: calls.append(1), repeats=5, warmup=2) >= 0
    assert len(calls) == 7


def test_a_process_cpu_time_counts_every_thread_to_the_process_clock():
    """``process_cpu_seconds`` of this process grows by what the process's own clock says it spent, a second
    thread's work included, and finer than the 10 ms clock ticks (each cost per object is a difference of
    these)."""
    import os
    import threading
    import time

    from distbelief.simulate.calibrate import process_cpu_seconds

    def spin(n: int) -> None:
        x = 0
        for i in range(n):
            x += i

    spin(1000)
    before, clock = process_cpu_seconds([os.getpid()]), time.process_time()
    worker = threading.Thread(target=spin, args=(300_000,))
    worker.start()
    spin(300_000)
    worker.join()
    grew, spent = process_cpu_seconds([os.getpid()]) - before, time.process_time() - clock
    assert spent > 0.01
    assert grew == pytest.approx(spent, rel=0.1, abs=0.004)
    small = process_cpu_seconds([os.getpid()])
    spin(20_000)  # about a millisecond: far under one tick
    assert 0 < process_cpu_seconds([os.getpid()]) - small < 0.01


def test_steps_that_noise_left_without_a_fit_are_timed_again_with_more_repeats(monkeypatch):
    from distbelief.simulate import calibrate as cal

    timed, lines = [], []

    def measure(rep, log):
        timed.append(rep.step)
        return [("m", len(timed), 0.0)]

    def fit(points):
        if points[0] < 3:  # the first two timings: noise
            raise cal.NoPositiveFit("no fit of a, b with positive coefficients")
        return 0.0, 0.0, {}

    monkeypatch.setattr(cal, "measure_steps", measure)
    monkeypatch.setattr(cal, "fit_steps", fit)
    assert cal.measure_fitted_steps(cal.QUICK, lines.append) == [("m", 3, 0.0)]
    assert timed == [cal.QUICK.step, 3 * cal.QUICK.step, 9 * cal.QUICK.step]
    assert [line.split(";")[0] for line in lines] == ["the steps do not fit (no fit of a, b with positive "
                                                     "coefficients)"] * 2
    timed.clear()
    with pytest.raises(cal.NoPositiveFit):
        cal.measure_fitted_steps(cal.QUICK, lines.append, tries=2)
    assert len(timed) == 2
