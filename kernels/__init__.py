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
    lib.pinfer_down.argtypes = [c_int, p, p, p, p, p, i64, i64, i64, c_int]
    lib.pinfer_down.restype = None
    return lib


_lib = _load()

# format -> (code in kernels/csrc/ffn_down.c, {part: (dtype, shape(n, d))})
_DOWN_FORMATS = {
    "q8": (0, {"q": (np.uint8, lambda n, d: (n, d)), "scale": (np.float16, lambda n, d: (n, d // 32))}),
    "q8r": (1, {"q": (np.uint8, lambda n, d: (n, d)), "scale": (np.float16, lambda n, d: (n // 32, d))}),
    "q4r": (2, {"q": (np.uint8, lambda n, d: (n, d // 2)), "scale": (np.float16, lambda n, d: (n // 32, d)),
                "min": (np.float16, lambda n, d: (n // 32, d))}),
    "f16": (3, {"w": (np.float16, lambda n, d: (n, d))}),
    "f32": (4, {"w": (np.float32, lambda n, d: (n, d))}),
    "q4": (5, {"q": (np.uint8, lambda n, d: (n, d // 2)), "scale": (np.float16, lambda n, d: (n, d // 32)),
               "min": (np.float16, lambda n, d: (n, d // 32))}),
}

_OPTIONAL_PARTS = {"min"}    # q4 and q4r without min: w = scale * (q - 8)


def _check(a, dtype, shape, name):
    if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous {np.dtype(dtype)} array of shape {shape}, "
                         f"got {a.dtype} {a.shape}")


class DownProjection:
    """y (S, d) = h (S, n_ff) @ W, W stored neuron-major as `down_t` (n_ff, d) in one of
    _DOWN_FORMATS. Shapes are checked here once; the bound call passes raw pointers only."""

    def __init__(self, fmt, parts, threads, n_ff, d):
        if fmt not in _DOWN_FORMATS:
            raise ValueError(f"the down kernel takes {sorted(_DOWN_FORMATS)}, not {fmt}")
        if d % 32 or n_ff % 32:
            raise ValueError(f"n_ff {n_ff} and d_model {d} must be multiples of 32")
        self.code, spec = _DOWN_FORMATS[fmt]
        missing = [p for p in spec if p not in parts and p not in _OPTIONAL_PARTS]
        if missing:
            raise ValueError(f"down_t in {fmt} needs the parts {sorted(spec)}; {', '.join(missing)} missing")
        for part, (dtype, shape) in spec.items():
            if part in parts:
                _check(parts[part], np.dtype(dtype), shape(n_ff, d), f"down_t.{part}")
        self.parts, self.threads, self.n_ff, self.d = parts, threads, n_ff, d
        ptr = lambda k: parts[k].ctypes.data if k in parts else None  # noqa: E731
        self._w = (ptr("q") or ptr("w"), ptr("scale"), ptr("min"))

    def bind(self, h, y):
        """Fix the input and output buffers; returns a zero-argument callable."""
        S = h.size // self.n_ff
        for a, n, name in ((h, self.n_ff, "h"), (y, self.d, "y")):
            if a.dtype != np.float32 or not a.flags.c_contiguous or a.size != S * n:
                raise ValueError(f"down projection buffer {name} {a.dtype} {a.shape} does not hold {S} rows of {n}")
        args = (self.code, *self._w, h.ctypes.data, y.ctypes.data, S, self.n_ff, self.d, self.threads)
        f = _lib.pinfer_down
        return lambda: f(*args)
