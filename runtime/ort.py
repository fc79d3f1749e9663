"""ONNX Runtime plumbing: session options, buffers in host or device memory, sessions bound to
them once (IOBinding), the down projection as MatMulNBits, and graph surgery."""

import ctypes
import threading

import numpy as np
import onnxruntime as ort

from pinfer import kernels
from pinfer.formats import schema as S
from pinfer.formats.reader import huge_empty


from onnxruntime.capi import onnxruntime_pybind11_state as _state

# What ONNX Runtime raises (its own classes derive from Exception alone; a failed run raises
# RuntimeError): caught where a session is made or run, and said as one sentence naming the graph.
ORT_ERRORS = (RuntimeError,) + tuple(getattr(_state, n) for n in ("Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError",
                                                "RuntimeException", "InvalidProtobuf", "ModelLoaded",
                                                "NotImplemented", "InvalidGraph", "EPFail") if hasattr(_state, n))


class GraphError(ValueError):
    """ONNX Runtime failed while running one of the runtime's graphs."""


def one_line(e, limit=300):
    """The first line of an exception's message, at most `limit` characters."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


_shared_arena = False
_arena_lock = threading.Lock()     # loading makes sessions on several threads (loading.load_map)


def _register_shared_arena():
    """One CPU arena for every session of the process. Each session otherwise keeps its own arena,
    grown to its largest call and never returned: a 512-token prefill left SmolLM2's 31 sessions
    holding 1.2 GB, against 0.48 GB shared, at the same speed."""
    global _shared_arena
    with _arena_lock:
        if not _shared_arena:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
            _shared_arena = True


def session_options(threads):
    _register_shared_arena()
    so = ort.SessionOptions()
    so.add_session_config_entry("session.use_env_allocators", "1")
    so.log_severity_level = 4       # errors reach the user as one sentence (ORT_ERRORS), not as log lines
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Sessions run one after another on the same cores: spinning pools would fight each other.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


class MatMulDown:
    """The down projection as ONNX Runtime's MatMulNBits over W_down (d, n_ff), rebuilt in memory
    at load from the file's q4r/q8r down_t: an exact transpose, since those formats keep GGUF's
    groups, which run along n_ff, MatMulNBits' K. Every row is read, like DownProjection, only
    faster; h is quantized to int8 per block of 32, as for every other MatMulNBits (and as
    llama.cpp does). Same bind(h, y) contract as DownProjection."""

    FORMATS = ("q4r", "q8r")

    def __init__(self, fmt, parts, threads, n_ff, d):
        # W_down (d, n_ff), in huge pages: the kernel's row dots stream it
        plain, w = kernels.untranspose_r(fmt, parts, empty=huge_empty)
        self.rows = (plain, w)     # the fused kernel's row dots read the same arrays
        self.arrays = {S.part_name("w", p): a for p, a in w.items()}
        directory = {name: {"dtype": S.DTYPE_CODES[a.dtype], "shape": list(a.shape), "nbytes": a.nbytes}
                     for name, a in self.arrays.items()}
        from pinfer.formats.onnx_graph import F32, GraphBuilder     # here: onnx takes 0.6 s to import
        b = GraphBuilder("down", directory)
        h = b.input("h", F32, [1, "S", n_ff])
        b.output(b.linear(h, "w", plain, d, n_ff), "y", F32, [1, "S", d])
        so = session_options(threads)
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays.values()]
        so.add_external_initializers(list(self.arrays), values)
        self.bound = Bound(ort.InferenceSession(b.build().SerializeToString(), so,
                                                 providers=["CPUExecutionProvider"]))
        self.bound.keep["initializers"] = values

    def bind(self, h, y):
        self.bound.bind_in("h", h.reshape(1, *h.shape))
        self.bound.bind_out("y", y.reshape(1, *y.shape))
        return self.bound.run


class SplitDown:
    """The down projection of a layer written with --quant mixed: rows [0, hot) in one format,
    the rest in another; the same bind(h, y) contract as DownProjection."""

    def __init__(self, hot, cold):
        self.hot, self.cold = hot, cold

    def bind(self, h, y):
        n_hot = self.hot.n_ff
        if h.shape[0] == 1:       # decode: both halves of the one row are contiguous already
            h_hot, h_cold = h[:, :n_hot], h[:, n_hot:]
            copy = None
        else:
            h_hot = np.empty((h.shape[0], n_hot), np.float32)
            h_cold = np.empty((h.shape[0], h.shape[1] - n_hot), np.float32)
            copy = (h, h_hot, h_cold, n_hot)
        y_cold = np.empty_like(y)
        run_hot, run_cold = self.hot.bind(h_hot, y), self.cold.bind(h_cold, y_cold)

        def run():
            if copy:
                src, a, b, k = copy
                np.copyto(a, src[:, :k])
                np.copyto(b, src[:, k:])
            run_hot()
            run_cold()
            np.add(y, y_cold, out=y)
        return run


class Buf:
    """An activation or cache buffer as an OrtValue: in host memory (with a NumPy view), on the GPU
    the dense part runs on (ONNX Runtime allocates it; `ptr` is its device address), or "emulated":
    host memory reached like a device's, through write/read and copies by address, never a view.
    Device buffers are zeroed once here: the device's allocator returns whatever was there."""

    def __init__(self, shape, dtype, device="cpu"):
        self.shape, self.dtype, self.device = tuple(shape), np.dtype(dtype), device
        if device == "cpu":
            self.np = np.zeros(shape, dtype)
            self.ov = ort.OrtValue.ortvalue_from_numpy(self.np)
        else:
            self.np = None
            if device == "emulated":
                self._memory = DeviceEmulation.allocate(shape, self.dtype)
                self.ov = ort.OrtValue.ortvalue_from_numpy(self._memory)
            else:
                self.ov = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self.dtype.type, "cuda", 0)
            self.zero()
        self.ptr = self.ov.data_ptr()

    def write(self, array):
        if self.np is not None:
            self.np[...] = array
        else:
            self.ov.update_inplace(np.ascontiguousarray(array, self.dtype).reshape(self.shape))

    def zero(self):
        self.write(np.zeros(self.shape, self.dtype)) if self.np is None else self.np.fill(0)

    def read(self):
        return self.np if self.np is not None else self.ov.numpy()


class DeviceEmulation:
    """The dense part's device plumbing on the CPU (dense_device "emulated-gpu"), faithful where
    the GPU path can go wrong without a GPU showing it:
    - ONNX Runtime copies a host input that a CUDA kernel consumes to the device when it is bound,
      not when the session runs: a host array updated after binding keeps its first value there.
      Here every host input is copied at bind time too, except those the CUDA kernels read on
      the host (HOST_INPUTS: GroupQueryAttention's total_sequence_length, input 6);
    - device memory comes uninitialised: emulated buffers start as NaN (all ones for integers);
    - device buffers are reached through copies by address (to_host, to_device), as the FFN
      steps reach the GPU's, and `pinned` arrays stand in for page-locked host memory."""

    HOST_INPUTS = {("GroupQueryAttention", 6)}    # (op, input index) a CUDA kernel reads on the host

    @staticmethod
    def allocate(shape, dtype):
        fill = np.nan if np.issubdtype(dtype, np.floating) else -1
        return np.full(shape, fill, dtype)

    @classmethod
    def host_read(cls, graph):
        """Names of the graph's inputs that the CUDA kernels read on the host."""
        return {node.input[k] for node in graph.node for op, k in cls.HOST_INPUTS
                if node.op_type == op and len(node.input) > k and node.input[k]}

    @staticmethod
    def pinned(n, dtype):
        return np.zeros(max(1, n), dtype)[:n]

    @staticmethod
    def to_host(host, src):
        ctypes.memmove(host.ctypes.data, src, host.nbytes)

    @staticmethod
    def to_device(dst, host):
        ctypes.memmove(dst, np.ascontiguousarray(host).ctypes.data, host.nbytes)

    @staticmethod
    def sync():
        pass


class Bound:
    """A session with one IOBinding whose inputs and outputs are NumPy arrays or Bufs, by name.
    snapshot: under DeviceEmulation, the input names the device reads on the host; every other
    host input is copied when bound, as ONNX Runtime's CUDA provider does."""

    def __init__(self, session, snapshot=None, what="a graph"):
        self.sess, self.what = session, what
        self.io = session.io_binding()
        self._run = session._sess.run_with_iobinding   # the raw call: ~2 µs against ~50 µs
        self._ro = ort.RunOptions()
        self._ro.log_severity_level = 4
        self.keep = {}
        self.snapshot = snapshot

    def bind_in(self, name, array):
        if self.snapshot is not None and name not in self.snapshot:
            host = array.np if isinstance(array, Buf) else array
            array = host.copy() if host is not None else array     # a device Buf has no host view
        self.keep[name] = array
        self.io.bind_ortvalue_input(name, array.ov if isinstance(array, Buf) else ort.OrtValue.ortvalue_from_numpy(array))

    def bind_out(self, name, array):
        self.keep["out:" + name] = array
        self.io.bind_ortvalue_output(name, array.ov if isinstance(array, Buf) else ort.OrtValue.ortvalue_from_numpy(array))

    def run(self):
        try:
            self._run(self.io._iobinding, self._ro)
        except ORT_ERRORS as e:     # a try costs nothing until it catches (Python 3.11)
            raise GraphError(f"ONNX Runtime failed running {self.what}: {one_line(e)}") from None


def drop_output(graph, name):
    """Remove the output `name` and every node and initializer only it needed. ONNX Runtime does
    not prune them itself: attention-only sessions kept computing gate/up (a 7B layer's 50 MB),
    which made the fused kernel's decode slower than dense."""
    keep = [o for o in graph.output if o.name != name]
    del graph.output[:]
    graph.output.extend(keep)
    needed = {o.name for o in keep}
    nodes = []
    for node in reversed(graph.node):
        if any(out in needed for out in node.output):
            nodes.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(nodes))
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)

