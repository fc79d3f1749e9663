"""The model configuration stored in a `.pinf` header, shared by converter and runtime."""

import dataclasses
from dataclasses import dataclass


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
    ffn_act: str = "silu"   # activation of the gate: "silu" (SwiGLU) or "relu" (ReGLU)
    tied_embeddings: bool = False

    @classmethod
    def from_dict(cls, d):
        """Build from a header dict: unknown keys are ignored, missing required ones named."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [n for n, f in fields.items()
                   if n not in d and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"the model configuration lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in fields})

    def to_dict(self):
        return dataclasses.asdict(self)
