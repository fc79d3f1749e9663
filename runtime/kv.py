"""The attention state every layer session shares: the KV cache (a buffer per layer and per K/V,
bound as both past and present: GroupQueryAttention writes in place), the RoPE tables and the
lengths, in host memory or in the device memory the dense part runs in."""

import numpy as np

from .ort import Buf


def rope_tables(cfg, n_ctx, freq_divisors=None, local=False):
    """cos/sin caches (n_ctx, rotary_dim/2) for positions 0..n_ctx-1; local: the windowed layers'
    own base, unscaled (cfg.rope_local)."""
    half = cfg.rotary_dim // 2
    base, scale = (cfg.rope_base_local, 1.0) if local else (cfg.rope_base, cfg.rope_linear_scale)
    inv = base ** (-np.arange(half, dtype=np.float64) * 2 / cfg.rotary_dim)
    if freq_divisors is not None and not local:
        inv = inv / np.asarray(freq_divisors, np.float64)
    pos = np.arange(n_ctx, dtype=np.float64) / scale
    ang = np.outer(pos, inv)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)



class AttentionState:
    """dtype: the activations' (and the RoPE tables'); kv_dtype: the cache's (default dtype). An f16
    cache under f32 activations is written by the C attention in place and, after each session,
    from the graph's new_key/new_value outputs (write_back; graphs.layer_graph says why)."""

    def __init__(self, cfg, n_ctx, dtype, device, freq_divisors=None, kv_dtype=None):
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        kv_shape = (1, cfg.n_head_kv, n_ctx, cfg.head_dim)
        self.kv = [(Buf(kv_shape, kv_dtype, device), Buf(kv_shape, kv_dtype, device)) for _ in range(cfg.n_layer)]
        self.writes_back = np.dtype(kv_dtype) != np.dtype(dtype)
        self.tables = {}          # local? -> (cos, sin), the windowed layers' own where they have one
        for local in sorted({cfg.rope_local(i) for i in range(cfg.n_layer)}):
            tables = rope_tables(cfg, n_ctx, freq_divisors, local)
            self.tables[local] = tuple(Buf(t.shape, dtype, device) for t in tables)
            for buf, table in zip(self.tables[local], tables):
                buf.write(table)
        self.local = [cfg.rope_local(i) for i in range(cfg.n_layer)]
        # GroupQueryAttention's lengths: seqlens_k (total length - 1) is read on the device, so it
        # lives there, written once per call for every layer (a host array would be copied to the
        # GPU once, when bound, and keep its first value); total_sequence_length is read on the host.
        self.seqlens = Buf((1,), np.int32, device)
        self.total = np.zeros((), np.int32)      # total length after this call

    @property
    def kv_bytes(self):
        return sum(2 * int(np.prod(k.shape)) * k.dtype.itemsize for k, _ in self.kv)    # K and V

    def bind(self, sessions):
        """Bind the KV cache, lengths and RoPE tables to layer sessions (Bound), layer i to sessions[i]
        (None: a layer without a session)."""
        for i, layer in enumerate(sessions):
            if layer is None:
                continue
            k, v, cos, sin = self.layer(i)
            for name, a in (("past_key", k), ("past_value", v), ("seqlens_k", self.seqlens),
                            ("total_len", self.total), ("cos_cache", cos), ("sin_cache", sin)):
                layer.bind_in(name, a)
            if not self.writes_back:        # else Steps binds new_key/new_value per call
                layer.bind_out("present_key", k)
                layer.bind_out("present_value", v)

    def write_back(self, i, new_k, new_v):
        """Layer i's K and V of the call's tokens (1, n_kv, n, head_dim), from its session's
        new_key/new_value, into the cache at their positions."""
        n, end = new_k.shape[2], int(self.total)
        k, v = self.kv[i]
        k.np[:, :, end - n:end] = new_k
        v.np[:, :, end - n:end] = new_v

    def layer(self, i):
        """Layer i's (K cache, V cache, cos table, sin table): its own base where it is windowed."""
        return (*self.kv[i], *self.tables[self.local[i]])

    def set_lengths(self, n_past, n):
        """The lengths of a call over n tokens after n_past cached ones."""
        self.seqlens.write(np.int32(n_past + n - 1))
        self.total[()] = n_past + n
