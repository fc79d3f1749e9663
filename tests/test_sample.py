import numpy as np
import pytest

from pinfer.runtime.sample import Sampler, SamplerConfig

VOCAB = 49152  # SmolLM2's


def random_logits(seed: int, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, vocab).astype(np.float32)


def draw_counts(config: SamplerConfig, logits: np.ndarray, n: int) -> np.ndarray:
    sampler = Sampler(config)
    return np.bincount([sampler.sample(logits, ()) for _ in range(n)], minlength=len(logits))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def test_greedy_is_argmax():
    sampler = Sampler(SamplerConfig(temp=0.0))
    for seed in range(5):
        logits = random_logits(seed)
        assert sampler.sample(logits, [1, 2, 3]) == int(np.argmax(logits))


def test_top_k_one_is_argmax():
    sampler = Sampler(SamplerConfig(temp=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=3))
    logits = random_logits(7)
    assert {sampler.sample(logits, ()) for _ in range(50)} == {int(np.argmax(logits))}


def test_seed_determinism_and_recorded_seed():
    logits = random_logits(1)
    config = SamplerConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a, b = Sampler(config), Sampler(config)
    assert [a.sample(logits, ()) for _ in range(100)] == [b.sample(logits, ()) for _ in range(100)]
    random_seeded = Sampler(SamplerConfig())
    assert random_seeded.seed >= 0
    replay = Sampler(SamplerConfig(seed=random_seeded.seed))
    assert [random_seeded.sample(logits, ()) for _ in range(20)] == [
        replay.sample(logits, ()) for _ in range(20)]


def test_unfiltered_draws_follow_softmax_with_temperature():
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    config = SamplerConfig(temp=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    freq = draw_counts(config, logits, 20000) / 20000
    np.testing.assert_allclose(freq, softmax(logits / 0.5), atol=0.01)


def test_min_p_excludes_tokens_below_fraction_of_top():
    # p relative to the top: 1, 0.2, 0.1, 0.04 (below min_p = 0.05), 0.01
    rel = np.array([1.0, 0.2, 0.1, 0.04, 0.01])
    logits = np.log(rel).astype(np.float32)
    config = SamplerConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.05, seed=5)
    counts = draw_counts(config, logits, 20000)
    assert counts[3] == 0 and counts[4] == 0
    freq = counts[:3] / counts.sum()
    np.testing.assert_allclose(freq, rel[:3] / rel[:3].sum(), atol=0.015)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])  # cumulative 0.5, 0.8, 0.95, 1.0
    logits = np.log(probs).astype(np.float32)
    counts = draw_counts(SamplerConfig(temp=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=9), logits,
                         20000)
    assert counts[2] == 0 and counts[3] == 0
    np.testing.assert_allclose(counts[:2] / counts.sum(), [0.625, 0.375], atol=0.015)


def test_top_p_normalises_over_top_k_survivors():
    # After top-k=2 the kept mass renormalises to [0.625, 0.375]: top-p 0.6 keeps one token.
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    counts = draw_counts(SamplerConfig(temp=1.0, top_k=2, top_p=0.6, min_p=0.0, seed=2), logits,
                         2000)
    assert counts[0] == 2000


def test_filters_use_temperature_one_probabilities():
    # At temp 3 token 3 would pass min-p, but llama.cpp applies temperature after min-p.
    rel = np.array([1.0, 0.5, 0.2, 0.03])
    counts = draw_counts(SamplerConfig(temp=3.0, top_k=0, top_p=1.0, min_p=0.05, seed=4),
                         np.log(rel).astype(np.float32), 5000)
    assert counts[3] == 0 and counts[2] > 0


def test_defaults_on_model_sized_logits_stay_in_kept_set():
    logits = random_logits(11)
    probs = softmax(logits)
    top40 = np.argsort(-logits)[:40]
    kept = top40[probs[top40] >= 0.05 * probs.max()]
    sampler = Sampler(SamplerConfig(seed=0))
    assert {sampler.sample(logits, ()) for _ in range(300)} <= set(kept.tolist())


def reference_penalty(logits: np.ndarray, history, penalty: float, last_n: int) -> np.ndarray:
    out = logits.copy()
    for token in set(history[-last_n:]):
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    return out


def test_repeat_penalty_matches_llamacpp_rule():
    logits = np.array([3.0, -2.0, 0.5, 4.0, -0.1, 1.0], dtype=np.float32)
    history = [5, 0, 1, 1, 4, 0, 2]  # with last_n = 5 the window is [1, 4, 0, 2] + 1
    config = SamplerConfig(temp=0.0, repeat_penalty=1.3, repeat_last_n=5)
    sampler = Sampler(config)
    penalized = sampler._penalize(logits, history)
    np.testing.assert_array_equal(penalized, reference_penalty(logits, history, 1.3, 5))
    assert penalized[5] == logits[5]  # outside the window
    assert logits[0] == 3.0  # caller's array untouched


def test_repeat_penalty_changes_greedy_choice():
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    greedy = Sampler(SamplerConfig(temp=0.0, repeat_penalty=1.1))
    assert greedy.sample(logits, [0]) == 1
    assert greedy.sample(logits, [2]) == 0


def test_repeat_window_all_and_off():
    logits = np.array([2.0, 1.0, -5.0], dtype=np.float32)
    history = [0] + [2] * 100  # token 0 lies 101 tokens back

    def greedy(last_n):
        return Sampler(SamplerConfig(temp=0, repeat_penalty=4.0, repeat_last_n=last_n)).sample(
            logits, history)

    assert greedy(-1) == 1   # whole history: 0 is penalised to 0.5
    assert greedy(64) == 0   # 0 is outside the window
    assert greedy(0) == 0    # penalty off


def test_invalid_settings_are_named():
    with pytest.raises(ValueError, match="min_p"):
        SamplerConfig(min_p=1.5)
    with pytest.raises(ValueError, match="repeat_penalty"):
        SamplerConfig(repeat_penalty=0.0)


def test_broken_logits_are_reported():
    with pytest.raises(ValueError, match="NaN or all -inf"):
        Sampler(SamplerConfig(seed=0)).sample(np.full(10, -np.inf, dtype=np.float32), ())

