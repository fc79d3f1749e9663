"""Perplexity with llama.cpp's protocol (llama-perplexity): tokenize the whole text once, cut it
into consecutive chunks of n_ctx tokens, run each chunk from an empty cache, and score only the
predictions of its second half (positions n_ctx/2 .. n_ctx-2 predict the next token). When the
model adds BOS, the first token of every chunk is replaced by BOS."""

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    stderr: float        # of the perplexity, from the per-token log-likelihoods
    tokens_scored: int
    chunks: int
    chunk_ppls: tuple


def log_softmax_at(logits, targets):
    """log p(target) per row of logits (n, vocab), computed in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    return x[np.arange(len(targets)), targets] - lse


def perplexity(model, tokenizer, text, n_ctx=512, n_chunks=-1, on_chunk=None):
    add_bos = tokenizer.add_bos and tokenizer.bos_id is not None
    tokens = tokenizer.encode(text, add_bos=add_bos, parse_special=False)
    available = len(tokens) // n_ctx
    if available == 0:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}; "
                         "use a longer text or a smaller -c")
    n_chunks = available if n_chunks < 0 else min(n_chunks, available)
    first = n_ctx // 2
    nll_all, chunk_ppls = [], []
    for c in range(n_chunks):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        if add_bos:
            chunk = [tokenizer.bos_id] + chunk[1:]
        model.reset()
        logits = model.forward(chunk, logits_from=first)         # (n_ctx - first, vocab)
        lp = log_softmax_at(logits[:-1], np.asarray(chunk[first + 1:]))
        nll_all.append(-lp)
        chunk_ppls.append(math.exp(-lp.mean()))
        if on_chunk:
            nll = np.concatenate(nll_all)
            on_chunk(c + 1, n_chunks, math.exp(nll.mean()))
    nll = np.concatenate(nll_all)
    ppl = math.exp(nll.mean())
    stderr = ppl * nll.std(ddof=1) / math.sqrt(len(nll)) if len(nll) > 1 else 0.0
    return PerplexityResult(ppl, stderr, len(nll), n_chunks, tuple(chunk_ppls))
