"""Verification after writing: reload the `.pinf` with the runtime and compare with the source.

Checks the tokenizer round trip, teacher-forced logits of a held-out calibration sequence against
the converter's PyTorch forward of the source weights (dense), and the held-out perplexity of the
file as it will run (its per-layer modes) against the same file run dense.
"""

import math
import sys
import time

import numpy as np

SAMPLES = ("Hello, world! 1234 + 5678 = 6912.", "  leading spaces, tabs\tand\nnew lines  ",
           "Ünïcödé: naïve café, 東京, emoji 🙂.")
TEACHER_TOKENS = 128
PPL_SEQUENCES = 8
TOP1_WARN = 0.9     # below this teacher-forced top-1 agreement with the source, say so


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _nll(model, seq):
    from pinfer.runtime.perplexity import log_softmax_at
    model.reset()
    logits = model.forward(list(seq), logits_from=0)
    return -log_softmax_at(logits[:-1], np.asarray(seq[1:]))


def _finite_logits(model, ids):
    """Run `ids` (a batch call's worth at most) through a mapped model a layer at a time
    (loading.stream_layers); True, or ValueError where a logit is not finite."""
    from pinfer.kernels import MAX_BATCH
    from pinfer.runtime.loading import stream_layers
    ids = ids[:MAX_BATCH]
    stream_layers(model, len(ids))
    if not np.isfinite(model.forward(ids)).all():
        raise ValueError("verification failed: the converted model produces non-finite logits")
    return True


def verify_output(path, layout):
    from pinfer.runtime.model import Model, RuntimeOptions
    from pinfer.runtime.tokenizer import Tokenizer

    t0 = time.perf_counter()
    checks = {}
    seq_len = layout.calib_set.heldout.shape[1] if layout.calib_set is not None else 64
    # Without calibration as the runtime loads with --mmap, a layer at a time (loading.stream_layers),
    # so that the converter's peak stays about one layer above the conversion's; else the NumPy
    # rules' row counts need the graphs.
    plain = layout.calibration is None
    model = Model(path, RuntimeOptions(n_ctx=max(seq_len, TEACHER_TOKENS), device="cpu",
                                       kernels="auto" if plain else "off", mmap=plain))
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    texts = list(SAMPLES)
    bad = [t for t in texts if tok.decode(tok.encode(t, add_bos=False, parse_special=False)) != t]
    checks["tokenizer_round_trip"] = {"samples": len(texts), "failed": len(bad)}
    if bad:
        raise ValueError(f"verification failed: the tokenizer does not round-trip {bad[0]!r}")

    if plain:
        checks["finite_logits"] = _finite_logits(model, tok.encode(SAMPLES[0]) or [0])
        _log(f"verify: tokenizer round trip ok, logits finite ({time.perf_counter() - t0:.1f} s)")
        return checks

    # One Model, switched between the file's modes and dense: a second one would double the
    # converter's peak memory for no information.
    ref = layout.calibration.reference_logits[:TEACHER_TOKENS]
    seq = layout.calib_set.heldout[0][:TEACHER_TOKENS]
    model.set_sparsity("dense")
    model.reset()
    got = model.forward(list(seq), logits_from=0)
    diff = np.abs(got - ref)
    checks["teacher_forced"] = {
        "tokens": len(seq), "max_abs_diff": float(diff.max()),
        "rms_diff": float(np.sqrt((diff ** 2).mean())),
        "top1_agreement": float((got.argmax(1) == ref.argmax(1)).mean()),
    }
    held = layout.calib_set.heldout[:PPL_SEQUENCES]
    nll_dense = np.concatenate([_nll(model, s) for s in held])

    model.set_sparsity("")
    model.counters.reset()
    if model.sparsity_names == ["dense"]:       # the file runs dense: the same computation as above
        sparse, nll_plan = got, nll_dense
    else:
        model.reset()
        sparse = model.forward(list(seq), logits_from=0)
        model.counters.reset()
        nll_plan = np.concatenate([_nll(model, s) for s in held])
    checks["teacher_forced"]["top1_agreement_as_planned"] = float((sparse.argmax(1) == ref.argmax(1)).mean())
    gu, down = model.counters.fractions()
    checks["runtime_heldout"] = {
        "tokens": int(nll_dense.size), "dense_ppl": math.exp(nll_dense.mean()),
        "planned_ppl": math.exp(nll_plan.mean()),
        "increase": math.exp(nll_plan.mean() - nll_dense.mean()) - 1,
        "gate_up_rows_read": gu, "down_rows_read": down, "modes": model.sparsity_names,
    }
    _say(checks, time.perf_counter() - t0)
    return checks


def _say(checks, seconds):
    tf, rh = checks["teacher_forced"], checks["runtime_heldout"]
    gu, down = rh["gate_up_rows_read"], rh["down_rows_read"]
    if tf["top1_agreement"] < TOP1_WARN:
        _log(f"verify: warning: the file's dense top-1 agrees with the source model on only "
             f"{tf['top1_agreement']:.1%} of {tf['tokens']} tokens (expected at least {TOP1_WARN:.0%}); "
             "check the re-quantized tensors in the report's conversion_error")
    _log(f"verify: tokenizer round trip ok; teacher-forced {tf['tokens']} tokens vs PyTorch on the source: "
         f"max |dlogit| {tf['max_abs_diff']:.3f}, rms {tf['rms_diff']:.3f}, top-1 {tf['top1_agreement']:.1%} dense, "
         f"{tf['top1_agreement_as_planned']:.1%} as planned; runtime held-out perplexity {rh['dense_ppl']:.3f} dense, "
         f"{rh['planned_ppl']:.3f} as planned ({rh['increase']:+.2%}), rows read {gu:.1%} gate/up, "
         f"{down:.1%} down ({seconds:.1f} s)")
