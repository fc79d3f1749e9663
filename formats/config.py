"""The model configuration stored in a `.pinf` header, shared by converter and runtime."""

import dataclasses
import json
import math
from dataclasses import dataclass

# Bounds of the integer fields, checked when a header is read: far beyond any real model, tight
# enough that nothing sized by them can overflow or allocate without end.
_INT_BOUNDS = {"n_layer": (1, 4096), "d_model": (1, 65536), "n_ff": (1, 1 << 20), "n_head": (1, 4096),
               "n_head_kv": (1, 4096), "head_dim": (1, 4096), "vocab": (1, 1 << 24), "n_ctx_train": (1, 1 << 24),
               "rotary_dim": (0, 4096), "sliding_window": (0, 1 << 24), "sliding_pattern": (0, 4096)}
_CHOICES = {"ffn_act": ("silu", "relu", "drelu", "fatrelu", "gelu"), "norm": ("rms", "layer"),
            "positions": ("rope", "learned")}
_BOOLS = ("rope_interleaved", "tied_embeddings", "ffn_gated")
# Upper bounds of the float fields: far beyond any real model (rope_base 1e6-5e8, softcaps 30-50,
# Gemma's embed_scale sqrt(d_model)), so that a crafted header cannot overflow float32 through them.
_FLOAT_MAX = {"norm_eps": 1.0, "rope_base": 1e12, "rope_base_local": 1e12, "rope_linear_scale": 1e6,
              "embed_scale": 1e4, "attn_scale": 1e4, "attn_softcap": 1e6, "final_softcap": 1e6,
              "ffn_act_threshold": 1e6}
_ZERO_ALLOWED = ("ffn_act_threshold", "rope_base_local", "attn_softcap", "final_softcap", "attn_scale")


def _check_field(name, v, values):
    """Why the value of field `name` is not acceptable, or None."""
    if name in _INT_BOUNDS:
        lo, hi = _INT_BOUNDS[name]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            return f"expected a whole number from {lo} to {hi}"
    elif name in _CHOICES:
        if v not in _CHOICES[name]:
            return f"expected one of {', '.join(_CHOICES[name])}"
    elif name in _BOOLS:
        if not isinstance(v, bool):
            return "expected true or false"
    elif name == "arch":
        if not isinstance(v, str):
            return "expected a name"
    elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            (name not in _ZERO_ALLOWED and v <= 0) or (name != "ffn_act_threshold" and v < 0) or \
            abs(v) > _FLOAT_MAX.get(name, math.inf):
        return "expected a finite number" + ("" if name == "ffn_act_threshold" else
                                             " from 0" if name in _ZERO_ALLOWED else " above 0") + \
            (f" up to {_FLOAT_MAX[name]:g}" if name in _FLOAT_MAX else "")
    if name == "n_head_kv" and isinstance(values.get("n_head"), int) and not isinstance(values["n_head"], bool) \
            and values["n_head"] % v:
        return "expected a divisor of n_head"
    return None


@dataclass(frozen=True)
class ModelConfig:
    arch: str               # source architecture name, e.g. "llama"
    n_layer: int
    d_model: int
    n_ff: int               # FFN neurons per layer
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab: int
    n_ctx_train: int        # context length the model was trained for
    norm_eps: float
    rope_base: float
    rotary_dim: int         # leading dims of each head that RoPE rotates
    rope_interleaved: bool  # True: rotate adjacent pairs (2i, 2i+1), GGUF llama row order
    rope_linear_scale: float = 1.0   # positions are divided by this ("linear" RoPE scaling)
    # FFN: h = act(gate x) * (up x) when gated, else h = act(up x) (OPT's fc1); act is "silu"
    # (SwiGLU), "relu" (ReGLU, ReluLLaMA, OPT), "drelu" (Bamboo: relu on gate and on up) or
    # "fatrelu" (ProSparse: gate values at or below ffn_act_threshold become 0) or "gelu" (GeGLU:
    # tanh-approximated GELU on the gate; Gemma)
    ffn_act: str = "silu"
    tied_embeddings: bool = False
    ffn_gated: bool = True
    ffn_act_threshold: float = 0.0
    norm: str = "rms"         # "rms" (RMSNorm) or "layer" (LayerNorm with a bias)
    positions: str = "rope"   # "rope", or "learned": rows of pos_embd added to the embeddings
    sliding_window: int = 0   # attend to at most this many latest positions (0: all; Mistral)
    # Gemma 2/3: windowed and global layers alternate: with sliding_pattern N > 0, layer i is windowed
    # unless (i + 1) % N == 0 (0: every layer, when sliding_window is set); windowed layers rotate
    # with rope_base_local where it is set (Gemma 3: 10000, globals 1e6), unscaled
    sliding_pattern: int = 0
    rope_base_local: float = 0.0
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(d_model))
    attn_scale: float = 0.0   # attention's q.k scale (0: 1/sqrt(head_dim))
    attn_softcap: float = 0.0  # scores become c * tanh(scores / c) (0: none; Gemma 2: 50)
    final_softcap: float = 0.0  # the same on the logits (Gemma 2: 30)

    def windowed(self, i):
        """Whether layer i attends within sliding_window."""
        return bool(self.sliding_window) and (not self.sliding_pattern or (i + 1) % self.sliding_pattern != 0)

    def rope_local(self, i):
        """Whether layer i rotates with rope_base_local (unscaled) rather than rope_base."""
        return bool(self.rope_base_local) and self.windowed(i)

    @property
    def exact_sparse(self):
        """The FFN's zeros are exact (ReLU family): a neuron whose h is 0 needs no down row."""
        return self.ffn_act in ("relu", "drelu", "fatrelu")

    @classmethod
    def from_dict(cls, d):
        """Build from a header dict: unknown keys are ignored, missing required ones named."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [n for n, f in fields.items()
                   if n not in d and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"the model configuration lacks {', '.join(missing)}")
        values = {k: v for k, v in d.items() if k in fields}
        for name, v in values.items():
            why = _check_field(name, v, values)
            if why:
                raise ValueError(f"the model configuration's {name} is {json.dumps(v)[:40]}: {why}")
        cfg = cls(**values)
        if cfg.rotary_dim > cfg.head_dim or cfg.rotary_dim % 2:
            raise ValueError(f"the model configuration's rotary_dim is {cfg.rotary_dim}: expected an even number "
                             f"up to head_dim ({cfg.head_dim})")
        return cfg

    def to_dict(self):
        return dataclasses.asdict(self)
