"""pinfer's CPU kernels: a small C library built by `pip install`, called through ctypes.

Each wrapper checks shapes, dtypes and contiguity once, at this boundary (kernels/csrc says the
layouts)."""

import ctypes
import importlib.util
import os

import numpy as np


def _load():
    # Kernels run between ONNX Runtime calls on the same cores: idle OpenMP threads must sleep,
    # not spin against ONNX Runtime's pool. libgomp reads this when the library loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    spec = importlib.util.find_spec("pinfer.kernels._kernels")
    if spec is None or spec.origin is None:
        raise ImportError("pinfer's C kernels are not built; reinstall with `pip install -e .`")
    lib = ctypes.CDLL(spec.origin)
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pinfer_down_q8.argtypes = [p, p, p, p, i64, i64, i64, c_int]
    lib.pinfer_down_q8.restype = None
    lib.pinfer_down_f16.argtypes = [p, p, p, i64, i64, i64, c_int]
    lib.pinfer_down_f16.restype = None
    lib.pinfer_down_f32.argtypes = [p, p, p, i64, i64, i64, c_int]
    lib.pinfer_down_f32.restype = None
    return lib


_lib = _load()


def _check(a, dtype, shape, name):
    if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous {np.dtype(dtype)} array of shape {shape}, "
                         f"got {a.dtype} {a.shape}")


class DownProjection:
    """y (S, d) = h (S, n_ff) @ W, W stored neuron-major as `down_t` (n_ff, d) in q8, f16 or f32.

    Shapes are checked here once; `__call__` passes raw pointers only."""

    def __init__(self, fmt, parts, threads):
        self.fmt, self.threads = fmt, threads
        if fmt == "q8":
            self.q, self.scale = parts["q"], parts["scale"]
            self.n_ff, self.d = self.q.shape
            _check(self.q, np.uint8, (self.n_ff, self.d), "down_t.q")
            _check(self.scale, np.float16, (self.n_ff, self.d // 32), "down_t.scale")
        elif fmt in ("f16", "f32"):
            self.q = parts["w"]
            self.n_ff, self.d = self.q.shape
            _check(self.q, np.dtype(np.float16 if fmt == "f16" else np.float32), (self.n_ff, self.d), "down_t.w")
        else:
            raise ValueError(f"the dense down kernel takes q8, f16 or f32 weights, not {fmt}")
        if self.d % 32:
            raise ValueError(f"d_model {self.d} is not a multiple of 32")
        self._qp = self.q.ctypes.data
        self._sp = self.scale.ctypes.data if fmt == "q8" else None

    def bind(self, h, y):
        """Fix the input and output buffers; returns a zero-argument callable."""
        S = h.shape[-2] if h.ndim > 1 else 1
        _check(h, np.float32, h.shape, "h")
        if h.size != S * self.n_ff or y.size != S * self.d or y.dtype != np.float32 or not y.flags.c_contiguous:
            raise ValueError(f"down projection buffers h {h.shape} / y {y.shape} do not match "
                             f"n_ff {self.n_ff}, d {self.d}")
        hp, yp = h.ctypes.data, y.ctypes.data
        if self.fmt == "q8":
            f, args = _lib.pinfer_down_q8, (hp, self._qp, self._sp, yp, S, self.n_ff, self.d, self.threads)
        else:
            f = _lib.pinfer_down_f16 if self.fmt == "f16" else _lib.pinfer_down_f32
            args = (hp, self._qp, yp, S, self.n_ff, self.d, self.threads)
        return lambda: f(*args)
