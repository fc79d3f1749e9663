"""pinfer's CUDA kernels (pinfer/kernels/cuda/ffn_hot.cu): compiled at run time by NVRTC, cached on disk,
launched through the CUDA driver API of cuda-python (the `gpu` extra). Nothing here needs torch,
and everything but `Gpu` and `HotFFN` works on a machine without a GPU.

The cache key is the hash of the source and of csrc/codes.h (the codes it shares with the C kernels,
given to NVRTC as "codes.h"), the target architecture, NVRTC's version and the compile options:
~/.cache/pinfer/cuda/ffn_hot-sm_75-<key>.cubin ($PINFER_CACHE moves ~/.cache/pinfer).
"""

import ctypes
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pinfer.formats import blocks
from pinfer.formats import schema as S
from pinfer.kernels import ACTIVATIONS, FORMAT_CODES, GATE_UP_FORMATS, RULES, SPARSE_DOWN

SOURCE = Path(__file__).with_name("cuda") / "ffn_hot.cu"
HEADER = Path(__file__).with_name("csrc") / "codes.h"      # #include "codes.h" in SOURCE
KERNELS = ("pinfer_pred_hidden", "pinfer_select", "pinfer_quantize_x", "pinfer_gate_up", "pinfer_activate", "pinfer_axpy",
           "pinfer_axpy_det", "pinfer_merge")
OPTIONS = ("--std=c++17", "-default-device")   # no fast math: denormal h must survive as on the CPU
ALIGN = 256            # every device buffer starts on this boundary (cudaMalloc's own)
GU_FORMATS = {f: FORMAT_CODES[f] for f in GATE_UP_FORMATS}             # the same codes in ffn_hot.cu
DOWN_FORMATS = {f: FORMAT_CODES[f] for f in SPARSE_DOWN}    # the CPU computes the cold half's down_t too
THREADS = 256


class GpuError(OSError):
    """The GPU path cannot run: one sentence saying why and what to do."""


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise GpuError("the GPU kernels need cuda-python and NVRTC: pip install 'pinfer[gpu]' "
                       "(see README.md, GPU machines)") from None
    return nvrtc


def _check(result, what):
    """cuda-python returns (status, values...); raise on a failed status."""
    status, rest = result[0], result[1:]
    if int(status) != 0:
        raise GpuError(f"{what} failed: {status!r}")
    return rest[0] if len(rest) == 1 else rest


def nvrtc_version():
    nvrtc = _nvrtc()
    return tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))


def supported_archs():
    nvrtc = _nvrtc()
    return [int(a) for a in _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]


def cache_dir():
    root = os.environ.get("PINFER_CACHE") or Path.home() / ".cache" / "pinfer"
    return Path(root) / "cuda"


@dataclass(frozen=True)
class Compiled:
    image: bytes        # a cubin, or PTX text for the driver to finish
    kind: str           # "cubin" or "ptx"
    arch: int
    path: Path
    cached: bool        # read from the cache rather than compiled now


def compile_kernels(arch, cache=None):
    """ffn_hot.cu for sm_<arch> (75 = Turing): a cubin where this NVRTC knows the architecture,
    else PTX for the newest one it knows (the driver compiles that for the device)."""
    source, header = SOURCE.read_bytes(), HEADER.read_bytes()
    archs = supported_archs()
    if arch < min(archs):
        raise GpuError(f"this NVRTC {nvrtc_version()} compiles for sm_{min(archs)} upward, not sm_{arch}; "
                       "install an NVRTC that supports the GPU")
    kind, target = ("cubin", arch) if arch in archs else ("ptx", max(a for a in archs if a <= arch))
    key = hashlib.sha256(b"|".join([source, header, f"{kind}{target}".encode(), repr(nvrtc_version()).encode(),
                                    *(o.encode() for o in OPTIONS)])).hexdigest()[:20]
    path = Path(cache or cache_dir()) / f"ffn_hot-sm_{target}-{key}.{kind}"
    if path.exists():
        return Compiled(path.read_bytes(), kind, target, path, True)
    image = _compile(source, header, kind, target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tmp.write_bytes(image)
    os.replace(tmp, path)
    return Compiled(image, kind, target, path, False)


def _compile(source, header, kind, arch):
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(source, b"ffn_hot.cu", 1, [header], [b"codes.h"]), "nvrtcCreateProgram")
    try:
        gpu = f"sm_{arch}" if kind == "cubin" else f"compute_{arch}"
        opts = [f"--gpu-architecture={gpu}".encode(), *(o.encode() for o in OPTIONS)]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        log_size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffer it is given: a mutable one (b" " * n is immutable, and at
        # n = 1 it is the interpreter's shared b" ", which NVRTC would turn into b"\0" everywhere)
        log = bytearray(log_size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        if int(status) != 0:
            raise GpuError(f"NVRTC could not compile ffn_hot.cu for {gpu}: "
                           f"{bytes(log).rstrip(bytes(1)).decode(errors='replace').strip()}")
        get_size, get = ((nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if kind == "cubin"
                         else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
        image = bytearray(_check(get_size(prog), "size"))
        _check(get(prog, image), "image")
        return bytes(image)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# -- device memory of one layer's hot part ----------------------------------------------------

def _round(n):
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class HotSpec:
    """What one layer's hot prefix of k neurons holds on the GPU, from its formats and sizes alone:
    the planner and HotFFN count the same buffers (exact byte accounting)."""
    d: int
    n_ff: int
    gate_up: tuple        # (fmt, has_min)
    down: tuple           # (fmt, has_min)
    rank: int = 0         # predictor rank; 0 without a predictor on the GPU

    def weight_parts(self, k):
        """[(name, nbytes)] of the weights for k hot neurons."""
        d, r = self.d, self.rank
        weights = [("gu", *self.gate_up, 2 * k, d), ("dn", *self.down, k, d)]
        if r:
            weights += [("w1", "q8", False, r, d), ("w2", "q8", False, k, r)]
        parts = [(f"{name}.{part}", S.DTYPES[dtype].itemsize * int(np.prod(shape)))
                 for name, fmt, has_min, rows, cols in weights
                 for part, (dtype, shape) in S.block_parts(fmt, rows, cols, has_min).items()]
        return parts + ([("b2", k * 4)] if r else [])

    def scratch_parts(self, k):
        d, r = self.d, self.rank
        return [("iota", k * 4), ("x", d * 4), ("hid", max(r, 1) * 4), ("cand", k * 4), ("counts", 8),
                ("gu", 2 * k * 4), ("hval", k * 4), ("surv", k * 4), ("y", d * 4), ("cold", d * 4),
                ("xq", d), ("xs", d // 32 * 4), ("xsum", d // 32 * 4)]

    def layout(self, k):
        """{name: (offset, nbytes)} and the total bytes of the layer's one device allocation."""
        if k == 0:
            return {}, 0
        out, at = {}, 0
        for name, n in self.weight_parts(k) + self.scratch_parts(k):
            out[name] = (at, n)
            at += _round(n)
        return out, at

    def nbytes(self, k):
        return self.layout(k)[1]

    def supported(self):
        """None, or why the GPU kernels cannot hold this layer."""
        if self.gate_up[0] not in GU_FORMATS:
            return f"gate_up in {self.gate_up[0]}"
        if self.down[0] not in DOWN_FORMATS:
            return f"down_t in {self.down[0]}"
        if self.d % 32 or self.n_ff % 32 or self.rank % 32:
            return f"d_model {self.d}, n_ff {self.n_ff} and predictor rank {self.rank} that are not multiples of 32"
        return None


def q8_predictor(predictor):
    """The predictor as the GPU kernels read it: q8. A q4 one (the converter stores q4 where the CPU
    reads fewer bytes per token at the same recall) is rounded again to q8 from its stored values,
    each within half a q8 step (1/254 of its group's largest weight) of the scores its thresholds
    were chosen on; None stays None."""
    if predictor is None:
        return None
    w1, w2, b2 = predictor
    return (*(w if w[0] == "q8" else ("q8", blocks.quantize("q8", blocks.dequantize(*w))) for w in (w1, w2)), b2)


def check_arrays(spec, k, gate_up, down, predictor=None):
    """{device buffer name: host array} of a layer's k hot neurons, each checked against the
    bytes spec.layout(k) gives it: what the planner counts is what is copied."""
    arrays = {f"gu.{part}": a for part, a in gate_up[1].items()}
    arrays.update({f"dn.{part}": a for part, a in down[1].items()})
    if predictor is not None:
        (f1, w1), (f2, w2), b2 = predictor
        if (f1, f2) != ("q8", "q8"):
            raise ValueError(f"the GPU kernels read q8 predictors, not {f1} and {f2}")
        arrays.update({"w1.q": w1["q"], "w1.scale": w1["scale"], "w2.q": w2["q"], "w2.scale": w2["scale"],
                       "b2": b2})
    arrays["iota"] = np.arange(k, dtype=np.int32)
    layout, _ = spec.layout(k)
    planned = {name for name, _ in spec.weight_parts(k)} | {"iota"}
    if set(arrays) != planned:
        raise ValueError(f"the layer's parts {sorted(arrays)} are not the planned {sorted(planned)}")
    for name, a in arrays.items():
        floats = {"gu.w": spec.gate_up[0], "dn.w": spec.down[0]}
        want = (np.uint8 if name.endswith((".q", ".qh")) else np.int32 if name == "iota" else np.float32 if name == "b2"
                else np.dtype(floats[name].replace("f", "float")) if name in floats else np.float16)
        if layout[name][1] != a.nbytes or a.dtype != want or not a.flags.c_contiguous:
            raise ValueError(f"layer buffer {name}: {a.dtype} {a.nbytes} bytes against the plan's "
                             f"{np.dtype(want)} {layout[name][1]}")
    return arrays


# -- the driver ----------------------------------------------------------------------------------

class Gpu:
    """One CUDA device through the driver API: its primary context, one stream, the kernels."""

    def __init__(self, ordinal=0):
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            raise GpuError("the GPU path needs cuda-python: pip install 'pinfer[gpu]' (see README.md)") from None
        self.cu = cu
        try:
            status = cu.cuInit(0)
        except Exception as e:      # cuda-python raises when it finds no driver library at all
            raise GpuError(f"no NVIDIA driver was found ({e.__class__.__name__}): the GPU path needs one") from None
        _check(status, "cuInit (is the NVIDIA driver working?)")
        if _check(cu.cuDeviceGetCount(), "cuDeviceGetCount") <= ordinal:
            raise GpuError(f"no CUDA device {ordinal} on this machine")
        self.dev = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        attr = cu.CUdevice_attribute
        major = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev), "cc")
        minor = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev), "cc")
        self.arch = 10 * major + minor
        driver = _check(cu.cuDriverGetVersion(), "cuDriverGetVersion")      # e.g. 13000 for CUDA 13.0
        if driver // 1000 < nvrtc_version()[0]:
            raise GpuError(f"the NVIDIA driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, older than this "
                           f"NVRTC's CUDA {nvrtc_version()[0]}: update the driver (R580 or newer for CUDA 13) or "
                           "install an NVRTC of the driver's CUDA version")
        if self.arch < 75:
            raise GpuError(f"the GPU is sm_{self.arch}; pinfer's kernels need sm_75 (Turing) or newer")
        name = _check(cu.cuDeviceGetName(64, self.dev), "cuDeviceGetName")
        self.name = bytes(name).split(b"\0")[0].decode()
        self.ctx = _check(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.stream = _check(cu.cuStreamCreate(0), "cuStreamCreate")
        self.compiled = compile_kernels(self.arch)
        self.module = _check(cu.cuModuleLoadData(self.compiled.image), "cuModuleLoadData")
        self.fn = {k: _check(cu.cuModuleGetFunction(self.module, k.encode()), k) for k in KERNELS}
        self.allocated = 0

    def close(self):
        """Give back the kernels, the stream and this process's hold on the device's primary context
        (the runtime falling back to the CPU); best effort: the statuses are not checked."""
        cu = self.cu
        cu.cuStreamSynchronize(self.stream)
        cu.cuModuleUnload(self.module)
        cu.cuStreamDestroy(self.stream)
        cu.cuDevicePrimaryCtxRelease(self.dev)

    def mem_info(self):
        """(free, total) device bytes."""
        return _check(self.cu.cuMemGetInfo(), "cuMemGetInfo")

    def alloc(self, nbytes):
        ptr = _check(self.cu.cuMemAlloc(nbytes), f"cuMemAlloc of {nbytes} bytes")
        self.allocated += nbytes
        return int(ptr)

    def free(self, ptr, nbytes):
        _check(self.cu.cuMemFree(ptr), "cuMemFree")
        self.allocated -= nbytes

    def pinned(self, n, dtype):
        """A page-locked host array for the transfers of each token (free_pinned releases it)."""
        nbytes = max(1, n) * np.dtype(dtype).itemsize
        ptr = int(_check(self.cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        return np.frombuffer((ctypes.c_byte * nbytes).from_address(ptr), dtype)[:n]

    def free_pinned(self, array):
        _check(self.cu.cuMemFreeHost(array.ctypes.data), "cuMemFreeHost")

    def upload(self, dst, array):
        a = np.ascontiguousarray(array)
        _check(self.cu.cuMemcpyHtoD(dst, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")

    def to_device(self, dst, host):
        _check(self.cu.cuMemcpyHtoDAsync(dst, host.ctypes.data, host.nbytes, self.stream), "cuMemcpyHtoDAsync")

    def to_host(self, host, src):
        _check(self.cu.cuMemcpyDtoHAsync(host.ctypes.data, src, host.nbytes, self.stream), "cuMemcpyDtoHAsync")

    def zero(self, dst, words, value=0):
        _check(self.cu.cuMemsetD32Async(dst, value, words, self.stream), "cuMemsetD32Async")

    def launch(self, name, grid, block, args):
        """args: [(value, ctypes type)]."""
        grid = grid if isinstance(grid, tuple) else (grid, 1)
        vals, types = zip(*args)
        _check(self.cu.cuLaunchKernel(self.fn[name], grid[0], grid[1], 1, block, 1, 1, 0, self.stream,
                                      (vals, types), 0), name)

    def sync(self):
        _check(self.cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class HotFFN:
    """The hot prefix of one layer's FFN on the GPU: the same contract as SparseFFN's bind, split in
    start() (upload x, launch, return at once) and finish(cold) (merge the CPU's partial sum, copy
    y back). gate_up, down: (fmt, parts) cut to the k hot neurons; predictor: ((fmt, w1 parts),
    (fmt, w2 parts), b2) as SparseFFN takes it, w2 and b2 cut, in q8 on the GPU (q8_predictor)."""

    def __init__(self, gpu, spec, k, gate_up, down, predictor=None, act="silu", deterministic=False):
        self.gpu, self.spec, self.k, self.d = gpu, spec, k, spec.d
        self.act = ACTIVATIONS.index(act)
        self.deterministic = deterministic
        layout, total = spec.layout(k)
        self.base = gpu.alloc(total)
        self.bytes = total
        at = {name: self.base + off for name, (off, _) in layout.items()}
        self.at = at
        for name, a in check_arrays(spec, k, gate_up, down, q8_predictor(predictor)).items():
            gpu.upload(at[name], a)
        self.gu_fmt, self.dn_fmt = GU_FORMATS[gate_up[0]], DOWN_FORMATS[down[0]]
        self.host_x = gpu.pinned(self.d, np.float32)
        self.host_y = gpu.pinned(self.d, np.float32)
        self.host_cold = gpu.pinned(self.d, np.float32)
        self.host_counts = gpu.pinned(2, np.int32)
        self.host_cand = gpu.pinned(k, np.int32)
        self.n_given = 0

    def close(self):
        """Return the device and pinned memory (the runtime re-plans when the modes change)."""
        if self.base:
            self.gpu.sync()
            self.gpu.free(self.base, self.bytes)
            for a in (self.host_x, self.host_y, self.host_cold, self.host_counts, self.host_cand):
                self.gpu.free_pinned(a)
            self.base = 0

    def set_candidates(self, cand):
        self.host_cand[:len(cand)] = cand
        self.n_given = len(cand)

    def survivors(self):
        """(ascending neuron indices, h values) of the last finished call's survivors, read back
        from the device, as SparseFFN.survivors (the load's self-check compares the two)."""
        n = int(self.host_counts[1])
        surv, hval = np.empty(n, np.int32), np.empty(self.k, np.float32)
        if n:
            self.gpu.to_host(surv, self.at["surv"])
        self.gpu.to_host(hval, self.at["hval"])
        self.gpu.sync()
        idx = np.sort(surv)         # appended with atomics: unordered
        return idx, hval[idx]

    def bind(self, x, y, mode, thr, pthr):
        """Host buffers x, y (float32 (d,)): start() copies x up and launches; finish(cold) merges
        the cold partial sum (or nothing), copies y down and returns (candidates, survivors)."""
        host_x, host_y = self.host_x, self.host_y
        launch = self._launcher(self.at["x"], self.at["y"], mode, thr, pthr)
        done = self._finisher(self.at["y"])

        def start():
            np.copyto(host_x, x)
            self.gpu.to_device(self.at["x"], host_x)
            launch()

        def finish(cold):       # y comes down after the merge
            counts = done(cold, before_sync=lambda: self.gpu.to_host(host_y, self.at["y"]))
            np.copyto(y, host_y)
            return counts
        return start, finish

    def bind_device(self, x_dev, y_dev, mode, thr, pthr):
        """Device buffers (float32 (d,)), the dense part being on the GPU: start() copies x down
        for the CPU's cold half (returned as the pinned array it fills) and launches the hot
        neurons reading x_dev; finish(cold) merges the cold partial sum into y_dev."""
        host_x = self.host_x
        launch = self._launcher(x_dev, y_dev, mode, thr, pthr)
        done = self._finisher(y_dev)

        def start():
            self.gpu.to_host(host_x, x_dev)
            self.gpu.sync()             # x is on the host before the CPU half starts
            launch()

        def finish(cold):
            return done(cold, before_sync=lambda: None)
        return start, finish, host_x

    def _finisher(self, y_ptr):
        g, at, d = self.gpu, self.at, self.d
        host_cold, host_counts = self.host_cold, self.host_counts

        def done(cold, before_sync):
            if cold is not None:
                np.copyto(host_cold, cold)
                g.to_device(at["cold"], host_cold)
                g.launch("pinfer_merge", -(-d // THREADS), THREADS, [(y_ptr, _P), (at["cold"], _P), (d, _I)])
            g.to_host(host_counts, at["counts"])
            before_sync()
            g.sync()
            return int(host_counts[0]), int(host_counts[1])
        return done

    def _launcher(self, x_ptr, y_ptr, mode, thr, pthr):
        """A callable queuing the hot neurons' kernels on the stream: x_ptr in, y_ptr out."""
        g, at, k, d = self.gpu, self.at, self.k, self.d
        warps = lambda n: -(-n * 32 // THREADS)   # noqa: E731  blocks of THREADS for n warps
        part = lambda p, name: at.get(f"{p}.{name}", 0)   # noqa: E731  null for a missing min
        gu = [(self.gu_fmt, _I), (part("gu", "q") or part("gu", "w"), _P), (part("gu", "scale"), _P),
              (part("gu", "min"), _P), (part("gu", "qh"), _P)]
        dn = [(self.dn_fmt, _I), (part("dn", "q") or part("dn", "w"), _P), (part("dn", "scale"), _P),
              (part("dn", "min"), _P)]
        candidates = S.MODES[mode].candidates
        cand = at["iota"] if candidates == "all" else at["cand"]
        count, nsurv = at["counts"], at["counts"] + 4
        rule, act = RULES[S.MODES[mode].rule], self.act
        quantized = self.gu_fmt in (GU_FORMATS["q4"], GU_FORMATS["q5"])   # int4/5 rows meet int8 x, as on the CPU

        def launch():
            g.zero(at["counts"], 2)
            g.zero(at["hval"], k)
            g.zero(y_ptr, d)
            if candidates == "all":
                g.zero(count, 1, k)
            elif candidates == "given":
                g.zero(count, 1, self.n_given)
                if self.n_given:
                    g.to_device(at["cand"], self.host_cand[:self.n_given])
            else:
                r = self.spec.rank
                g.launch("pinfer_pred_hidden", warps(r), THREADS,
                         [(at["w1.q"], _P), (at["w1.scale"], _P), (x_ptr, _P), (at["hid"], _P), (r, _I), (d, _I)])
                g.launch("pinfer_select", warps(k), THREADS,
                         [(at["w2.q"], _P), (at["w2.scale"], _P), (at["b2"], _P), (at["hid"], _P), (pthr, _F),
                          (k, _I), (r, _I), (cand, _P), (count, _P)])
            if quantized:
                g.launch("pinfer_quantize_x", warps(d // 32), THREADS,
                         [(x_ptr, _P), (d, _I), (at["xq"], _P), (at["xs"], _P), (at["xsum"], _P)])
            g.launch("pinfer_gate_up", warps(k), THREADS,
                     gu + [(x_ptr, _P), (at["xq"], _P), (at["xs"], _P), (at["xsum"], _P), (cand, _P), (count, _P),
                           (d, _I), (at["gu"], _P)])
            g.launch("pinfer_activate", -(-k // THREADS), THREADS,
                     [(at["gu"], _P), (cand, _P), (count, _P), (act, _I), (rule, _I), (thr, _F), (at["hval"], _P),
                      (at["surv"], _P), (nsurv, _P)])
            if self.deterministic:
                g.launch("pinfer_axpy_det", -(-d // THREADS), THREADS,
                         dn + [(at["hval"], _P), (k, _I), (d, _I), (y_ptr, _P)])
            else:
                g.launch("pinfer_axpy", (-(-k // 32), -(-d // THREADS)), THREADS,
                         dn + [(at["hval"], _P), (at["surv"], _P), (nsurv, _P), (d, _I), (y_ptr, _P)])
        return launch
