"""--ffn-kernel auto's choice at load must not follow whatever else the machine is doing. The same
7B-shaped file chose ONNX Runtime's dense path (its kernel timed at 1.43x) while another process
ran, and pinfer's kernel (0.545x) on an idle machine. Two things keep the choice: each way's
fastest token is its measure (autotune.ratios: a disturbance only adds time), and dense layers
whose attention pinfer's C kernels take are not timed at all (the kernel's dense mode won on every
CPU measured). These tests inject the noise; none of them reads a clock for an assertion."""

import numpy as np
import pytest

from pinfer.runtime import autotune
from pinfer.runtime.autotune import choose_path, ratios
from pinfer.runtime.model import Model, RuntimeOptions

TOKENS = autotune.TIMING_TOKENS - autotune.TIMING_WARMUP      # the tokens a timing counts


LAYERS = 8


def _disturbed(rng, true, p=0.5, worst=3.0):
    """(tokens, layers, 3) seconds [kernel, kernel-dense, dense] of ways whose undisturbed times
    over the layers are `true`: each run is slowed, with probability p, by a factor of up to
    `worst`, and the kernel's two ways, whose threads wait for each other, twice as hard (a busy
    core stalls the whole pool): up to 5x."""
    times = np.tile(np.asarray(true, float) / LAYERS, (TOKENS, LAYERS, 1))
    hit = rng.random(times.shape) < p
    factor = 1 + rng.random(times.shape) * (worst - 1)
    factor[..., :2] = 1 + 2 * (factor[..., :2] - 1)
    return np.where(hit, times * factor, times)


@pytest.mark.parametrize("true, want", [((0.55, 0.7, 1.0), "kernel"),        # the rule pays
                                        ((1.3, 0.6, 1.0), "kernel-dense"),   # the kernel's dense mode pays
                                        ((1.3, 1.2, 1.0), "dense")])         # ONNX Runtime's graph pays
def test_the_choice_holds_under_a_noisy_timer(true, want):
    """500 timings of 8 layers, half of all runs disturbed: every one chooses the same way."""
    rng = np.random.default_rng(0)
    chosen = {choose_path(*ratios(_disturbed(rng, true))) for _ in range(500)}
    assert chosen == {want}


def test_the_noise_is_enough_to_flip_a_median():
    """The same disturbance flips the statistic the load used before (the median of per-token
    ratios) in many of the 500 timings: the test above can fail."""
    rng = np.random.default_rng(0)
    flips = 0
    for _ in range(500):
        t = _disturbed(rng, (0.55, 0.7, 1.0)).sum(axis=1)      # per token, over the layers
        median = [float(np.median(t[:, k] / t[:, 2])) for k in (0, 1)]
        flips += choose_path(*median) != "kernel"
    assert flips > 20, flips


def test_dense_layers_the_c_kernels_take_are_not_timed(silu_file, monkeypatch):
    """A dense file whose attention pinfer's C kernels take runs its FFN through the kernel's dense
    mode, untimed: a timer that says every run of it takes a hundred times longer changes nothing."""
    real = autotune.clock
    state = {"t": 0.0}

    def hostile():
        state["t"] += 100.0             # every interval read through it looks 100 s long
        return real() + state["t"]
    monkeypatch.setattr(autotune, "clock", hostile)
    m = Model(silu_file, RuntimeOptions(threads=1, device="cpu", sparsity="dense"))
    [choice] = m.path_choices
    assert (choice.rule, choice.path, choice.tokens) == ("dense", "kernel-dense", 0)
    assert all(f is not None and f.mode == "dense" for f in [L.ffn for L in m.layers])
    assert "untimed" in choice.describe() and choice.quiet      # nothing measured: said with -v only


def test_the_load_times_through_the_injected_clock(silu_file, monkeypatch):
    """The timing of a sparse rule reads autotune.clock, so the noise above reaches it: a clock that
    adds a random delay to some readings still gives a choice and ratios the model reports."""
    rng = np.random.default_rng(1)
    real, reads = autotune.clock, []

    def noisy():
        reads.append(1)
        return real() + (rng.random() * 0.01 if rng.random() < 0.5 else 0.0)
    monkeypatch.setattr(autotune, "clock", noisy)
    m = Model(silu_file, RuntimeOptions(threads=1, device="cpu", sparsity="down:0.3"))
    [choice] = m.path_choices
    assert len(reads) > 2 * TOKENS and choice.tokens >= 3
    assert choice.path == choose_path(choice.kernel_over_dense, choice.kernel_dense_over_dense)
