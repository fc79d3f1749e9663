"""Generation: a session over one loaded model that yields one small Step record per token.

`generate`, `chat`, `serve` and `bench` all consume the same Steps. Timings follow llama.cpp:
prompt tok/s = prompt tokens / prefill time; decode tok/s = tokens after the first / their time."""

import time
from dataclasses import dataclass, field

from .model import ContextFull, Model, RuntimeOptions
from .sample import Sampler, SamplerConfig
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerateOptions:
    n_predict: int = 256             # -1: until an end-of-generation token or the context is full
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    ignore_eos: bool = False
    reuse_cache: bool = True         # keep the longest cached prefix of the prompt (False: prefill afresh)


@dataclass(frozen=True)
class Step:
    token: int
    text: str                        # newly completed text (may be "" mid-character)
    finish_reason: str | None        # None, "stop" (end-of-generation token) or "length"


@dataclass
class Stats:
    prompt_tokens: int = 0           # tokens actually computed in prefill (cached ones excluded)
    prompt_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prompt_tps(self):
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self):
        return (self.decode_tokens - 1) / self.decode_seconds if self.decode_tokens > 1 and self.decode_seconds else 0.0


class Session:
    """A model, its tokenizer and the tokens whose keys and values sit in the cache."""

    def __init__(self, path, options=RuntimeOptions()):
        self.model = Model(path, options)
        self.tokenizer = Tokenizer.from_spec(self.model.tokenizer_spec)
        self.cached = []             # token ids in the KV cache, in order
        self.stats = Stats()

    @property
    def n_ctx(self):
        return self.model.n_ctx

    def prefill(self, ids):
        """Make the cache hold exactly `ids`, reusing the longest cached prefix; returns the logits
        of the last token."""
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.n_ctx:
            raise ContextFull(0, len(ids), self.n_ctx)
        keep = 0
        for a, b in zip(self.cached, ids[:-1]):   # the last token is always recomputed for its logits
            if a != b:
                break
            keep += 1
        self.model.n_past = keep
        self.cached = list(ids[:keep])
        logits = self.model.forward(ids[keep:])[-1]
        self.cached = list(ids)
        self.last_prefill = len(ids) - keep
        return logits

    def generate(self, prompt_ids, options=GenerateOptions(), should_stop=None):
        """Yield a Step per generated token. `should_stop()` is polled between tokens."""
        stats = self.stats = Stats()
        sampler = Sampler(options.sampler)
        self.sampler = sampler
        t0 = time.perf_counter()
        if not options.reuse_cache:
            self.reset()
        logits = self.prefill(list(prompt_ids))
        stats.prompt_tokens = self.last_prefill
        stats.prompt_seconds = time.perf_counter() - t0
        decoder = self.tokenizer.stream()
        eog = self.tokenizer.eog_ids
        history = list(prompt_ids)
        n = 0
        t1 = time.perf_counter()
        while True:
            token = sampler.sample(logits, history)
            n += 1
            history.append(token)
            stats.decode_tokens = n
            if token in eog and not options.ignore_eos:
                stats.decode_seconds = time.perf_counter() - t1
                yield Step(token, decoder.flush(), "stop")
                return
            text = decoder.add(token)
            full = len(self.cached) + 1 > self.n_ctx
            if (options.n_predict >= 0 and n >= options.n_predict) or full or (should_stop and should_stop()):
                stats.decode_seconds = time.perf_counter() - t1
                yield Step(token, text + decoder.flush(), "length")
                return
            yield Step(token, text, None)
            if n == 1:
                t1 = time.perf_counter()   # decode speed counts the tokens after the first
            logits = self.model.forward([token])[-1]
            self.cached.append(token)

    def reset(self):
        self.cached = []
        self.model.reset()
