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
    # FFN: h = act(gate x) * (up x) when gated, else h = act(up x) (OPT's fc1); act is "silu"
    # (SwiGLU), "relu" (ReGLU, ReluLLaMA, OPT), "drelu" (Bamboo: relu on gate and on up) or
    # "fatrelu" (ProSparse: gate values at or below ffn_act_threshold become 0)
    ffn_act: str = "silu"
    tied_embeddings: bool = False
    ffn_gated: bool = True
    ffn_act_threshold: float = 0.0
    norm: str = "rms"         # "rms" (RMSNorm) or "layer" (LayerNorm with a bias)
    positions: str = "rope"   # "rope", or "learned": rows of pos_embd added to the embeddings
    sliding_window: int = 0   # attend to at most this many latest positions (0: all; Mistral)

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
        return cls(**{k: v for k, v in d.items() if k in fields})

    def to_dict(self):
        return dataclasses.asdict(self)
