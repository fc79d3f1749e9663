"""How a model runs: one frozen record of the runtime's choices, checked once when it is made."""

from dataclasses import dataclass

DEFAULT_CTX = 4096
KERNELS = ("auto", "on", "off")
FFN_DEVICES = ("auto", "cpu", "gpu", "cpu-split")
DENSE_DEVICES = ("auto", "cpu", "gpu", "cpu-fp16", "emulated-gpu")
KV_TYPES = ("f16", "f32")


@dataclass(frozen=True)
class RuntimeOptions:
    n_ctx: int = 0          # 0: the model's training context, capped at DEFAULT_CTX
    threads: int = 0        # 0: all cores
    verbose: bool = False
    sparsity: str = ""      # "": each layer's mode from the file; else dense | down:S | predicted:R | relu:R
    # How sparse layers decode: "on" through pinfer's fused FFN kernel (rows the rule skips are not
    # read), "off" through the ONNX graph + the NumPy rule (every row read: the reference path), or
    # "auto": time both the kernel and the dense path at load and run each rule's layers through
    # the kernel only where it is faster on this machine, dense elsewhere (on SmolLM2 the kernel
    # is slower; at LLaMA-7B's shape with 10% active it is 1.9x faster).
    kernels: str = "auto"
    # Where the FFN's hot neurons run: "gpu" (hybrid: hot on the GPU, cold on the CPU), "cpu", or
    # "auto" (the GPU where cuda-python finds one). "cpu-split" plans a split like "gpu" but runs
    # the hot half on a second CPU kernel: it checks the split and the merge without a GPU.
    device: str = "auto"
    vram_budget: float | None = None   # GiB for the GPU part; None: free VRAM minus a margin
    deterministic: bool = False        # the GPU's down projection in a fixed order (tests)
    # Where the dense part (attention, norms, head) runs: "cpu" (the default until the GPU path has
    # produced right output on a GPU since its fix), "auto" (ONNX Runtime's CUDA provider in FP16
    # when the FFN runs on a GPU and onnxruntime-gpu is installed, else its CPU provider), "gpu", "cpu-fp16" (the FP16 graphs on the CPU provider: tests the conversion), or
    # "emulated-gpu": the GPU's code path (device buffers reached only through copies, host inputs
    # copied when bound, memory not zeroed at allocation) over the FP16 graphs on the CPU provider:
    # CI's check of the device plumbing (see DeviceEmulation).
    dense_device: str = "cpu"
    # "on": where the fused FFN kernel decodes a layer, its attention runs through pinfer's C
    # kernels too (runtime/native.py says which layers they cover), and so does the head of a
    # one-token call; "off": ONNX Runtime's sessions for every dense step (the reference path).
    dense_kernel: str = "on"
    # The KV cache's values: "f16" (half of f32's memory, as llama.cpp's default cache; 4096
    # tokens of a 7B model take 2.1 GB instead of 4.3) or "f32". A dense part in FP16 keeps
    # its cache in f16 whatever this says.
    kv_type: str = "f16"
    # Where the C kernels read the weights from. None (auto): from the file's map where one copy of
    # the weights serves every step (loading.one_copy: large models all on the C kernels), which
    # loads in about a second (docs/benchmarks.md) and decodes as fast as copies where the page
    # cache holds the file in 2 MB folios (formats.reader._map); a dense layer's W_down is still
    # made from down_t. Elsewhere copies in 2 MB pages. True: the map always, and a dense layer's
    # down projection reads down_t (no W_down made: the least memory, a slower decode). False:
    # copies in 2 MB pages (loading.map_weights).
    mmap: bool | None = None
    # Activation sparsity (0: off): the share S of each FFN input dropped by magnitude, at the
    # thresholds the converter calibrated per layer (header layers[i] input_thresholds[S] for the
    # FFN's input, thresholds[S] for the down projection's): the layer runs by columns
    # (kernels.ColumnFFN over gate|up transposed at load), reading the rows of the inputs it keeps.
    # "auto": the level per projection the converter chose within its perplexity budget.
    activation: float | str = 0.0

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise ValueError(f"ffn kernel {self.kernels!r} is not one of auto, on, off")
        if self.device not in FFN_DEVICES:
            raise ValueError(f"device {self.device!r} is not one of auto, cpu, gpu")
        if self.dense_device not in DENSE_DEVICES:
            raise ValueError(f"dense device {self.dense_device!r} is not one of auto, cpu, gpu")
        if self.dense_kernel not in ("on", "off"):
            raise ValueError(f"dense kernel {self.dense_kernel!r} is not one of on, off")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"KV cache type {self.kv_type!r} is not one of {', '.join(KV_TYPES)}")
        if self.vram_budget is not None and not self.vram_budget >= 0:
            raise ValueError(f"--vram-budget {self.vram_budget:g} GiB is negative; give the GiB the GPU may use")
        act = self.activation
        if act != "auto" and not (isinstance(act, (int, float)) and 0.0 <= act < 1.0):
            raise ValueError(f"activation sparsity {self.activation!r} is not auto or a share of inputs from 0 (off) "
                             "to below 1, e.g. 0.3")
        if self.n_ctx < 0 or self.threads < 0:
            raise ValueError("the context size and the thread count are 0 (the default) or more")


@dataclass(frozen=True)
class Note:
    """Something loading decided that the user may want to read (a device fallback, the GPU
    plan, VRAM as allocated). The runtime prints nothing: a model keeps its notes (with
    autotune's records, which read the same way) and the CLI prints them, the quiet ones with -v."""
    text: str
    quiet: bool = False

    def describe(self):
        return self.text
