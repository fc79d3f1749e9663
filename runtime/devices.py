"""Where a model runs: the FFN's hot neurons (the CPU, an NVIDIA GPU, or a second CPU kernel that
checks the split without one), the dense part (ONNX Runtime's CPU provider in FP32 or FP16, its
CUDA provider in FP16, or the GPU's code path emulated on the CPU), the sessions built for that
place, and the VRAM plan of the hot neurons (noted before the weights move)."""

import numpy as np
import onnxruntime as ort

from pinfer.formats import PinfFormatError

from . import placement
from .options import Note
from .ort import ORT_ERRORS, Bound, DeviceEmulation, drop_output, one_line, session_options


class Devices:
    def __init__(self, reader, cfg, options):
        self.reader, self.cfg, self.options = reader, cfg, options
        self.gpu = None
        self.notes = []                 # Note records of what was chosen, for the CLI to print
        self.ffn = self._choose_ffn_device(options)
        self.dense = self._choose_dense_device(options)
        self._place_buffers()
        self.dense_weight_bytes = 0     # weights ONNX Runtime's CUDA provider holds
        self.kv_bytes = 0
        self.specs = None               # placement.layer_specs of the last plan
        self._free_at_start = self.gpu.mem_info()[0] if self.gpu else 0
        self._free_before = self.dense_measured = 0

    def _place_buffers(self):
        self.act_dtype = np.float16 if self.dense != "cpu" else np.float32   # resid, RoPE tables
        # the KV cache: f16 unless the options ask for f32 on a dense part in FP32
        self.kv_dtype = np.float16 if self.act_dtype == np.float16 or self.options.kv_type == "f16" else np.float32
        self.act_at = {"gpu": "cuda", "emulated-gpu": "emulated"}.get(self.dense, "cpu")
        # the dense part's buffers in device memory: the FFN steps reach them through `copier`
        self.on_device = self.act_at != "cpu"
        self.copier = self.gpu if self.act_at == "cuda" else DeviceEmulation

    def fall_back(self, why):
        """Everything on the CPU from now on (the self-check at load found the device wrong; it
        has freed what it put there): the FFN on the CPU kernels, the dense part in FP32. Runs
        before the model's sessions and buffers are made."""
        self.notes.append(Note(f"pinfer: running on the CPU: {why}"))
        if self.gpu is not None:
            self.gpu.close()
        self.ffn, self.dense, self.gpu, self._free_at_start = "cpu", "cpu", None, 0
        self._place_buffers()

    def _choose_ffn_device(self, options):
        if options.device in ("cpu", "cpu-split"):
            return options.device
        from pinfer.kernels.gpu import Gpu, GpuError
        try:
            self.gpu = Gpu()
        except GpuError as e:
            if options.device == "gpu":
                raise
            self.notes.append(Note(f"pinfer: running on the CPU ({e})", quiet=True))
            return "cpu"
        return "gpu"

    def _choose_dense_device(self, options):
        want = options.dense_device
        if want in ("cpu", "cpu-fp16"):
            return want
        from pinfer.kernels.gpu import GpuError
        why = None
        if want != "emulated-gpu" and self.ffn != "gpu":
            why = "the FFN runs on the CPU"
        elif want != "emulated-gpu" and "CUDAExecutionProvider" not in ort.get_available_providers():
            why = "this onnxruntime has no CUDA provider (install onnxruntime-gpu in its place)"
        elif any(spec is None for spec, _ in placement.layer_specs(self.reader, self.cfg, ["dense"] * self.cfg.n_layer)):
            why = "some layers' FFNs are not ones the GPU kernels take"
        if why and want != "auto":
            raise GpuError(f"the dense part cannot run on the GPU: {why}")
        return "cpu" if why else "gpu" if want == "auto" else want

    def loaded(self, kv_bytes):
        """The dense part is in place: note its KV cache and what loading it took from the device."""
        self.kv_bytes = kv_bytes
        if self.act_at == "cuda":
            self.dense_measured = self._free_at_start - self.gpu.mem_info()[0]

    def session(self, graph, threads, attention_only=False):
        """A Bound session of the file's graph `graph` for the dense part's place: attention_only
        drops the FFN's h output and everything only it needs."""
        from onnx import TensorProto    # here: importing onnx takes 0.6 s, and a one-copy load builds no graph

        from . import graphs
        proto = graphs.build(self.reader.path, self.reader.header, self.cfg, graph,
                             kv_f16=self.dense == "cpu" and self.kv_dtype == np.float16)
        if attention_only:
            drop_output(proto.graph, "ffn_h")
        halved = set()
        if self.dense != "cpu":
            from .fp16 import to_fp16
            halved = set(to_fp16(proto, keep_f32=("delta", "ffn_x", "ffn_h", "logits")))
        names, values = [], []
        for t in proto.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                names.append(t.name)
                a = self.reader.tensor(t.name)
                a = a.astype(np.float16) if t.name in halved else a
                values.append(ort.OrtValue.ortvalue_from_numpy(a))
                self.dense_weight_bytes += a.nbytes if self.dense == "gpu" else 0
        so = session_options(threads)
        so.add_external_initializers(names, values)
        if self.dense in ("cpu-fp16", "emulated-gpu"):
            so.log_severity_level = 3   # the CPU provider lacks some FP16 kernels and says so per node
        providers = ["CPUExecutionProvider"]
        if self.dense == "gpu":
            # one stream for ONNX Runtime's kernels and pinfer's: no event needed between them
            providers = [("CUDAExecutionProvider", {"device_id": "0",
                                                    "user_compute_stream": str(int(self.gpu.stream))}),
                         "CPUExecutionProvider"]
        what = f"the {graph} graph of {self.reader.path}"
        try:
            sess = ort.InferenceSession(proto.SerializeToString(), so, providers=providers)
        except ORT_ERRORS as e:
            raise PinfFormatError(f"ONNX Runtime cannot load {what}: {one_line(e)}; re-run `pinfer convert` "
                                  "to make a new file") from None
        if self.dense == "gpu" and sess.get_providers()[0] != "CUDAExecutionProvider":
            from pinfer.kernels.gpu import GpuError
            raise GpuError("ONNX Runtime could not start its CUDA provider (are CUDA 13 and cuDNN 9 installed? "
                           "see README.md); run with --device cpu, or fix the CUDA install")
        bound = Bound(sess, DeviceEmulation.host_read(proto.graph) if self.act_at == "emulated" else None, what)
        bound.keep["initializers"] = values   # ORT uses these buffers; keep them alive
        return bound

    def plan(self, modes, hotness=None):
        """The hot/cold split for this machine (placement.Plan), noted before the weights move."""
        budget = self.options.vram_budget
        if budget is None:
            if self.gpu is None:
                raise ValueError("device cpu-split needs a vram_budget to plan for")
            free, _ = self.gpu.mem_info()   # the dense part, if there, is in VRAM already
            reserved = self.reserved()
            budget_bytes = max(0, free - placement.MARGIN + reserved.get("dense weights", 0)
                               + reserved.get("KV cache", 0))
        else:
            budget_bytes = int(budget * placement.GIB)
        self.specs = placement.layer_specs(self.reader, self.cfg, modes)
        plan = placement.plan(self.reader, self.cfg, modes, budget_bytes, self.reserved(), mass=hotness)
        g = self.gpu
        where = (f"GPU {g.name} (sm_{g.arch}, kernels {g.compiled.kind} "
                 f"{'from the cache' if g.compiled.cached else 'compiled now'})" if g
                 else "a second CPU kernel (cpu-split)")
        dense = {"gpu": "the GPU (ONNX Runtime's CUDA provider, FP16)",
                 "emulated-gpu": "the CPU, through the GPU's code path (emulated-gpu, FP16 graphs)",
                 "cpu-fp16": "the CPU (ONNX Runtime's CPU provider, FP16 graphs)"}.get(
                     self.dense, "the CPU (ONNX Runtime's CPU provider)")
        self.notes.append(Note(f"{plan.describe()}\n  hot part on {where}; dense part and KV cache on {dense}",
                               quiet=self.ffn != "gpu"))
        self._free_before = self.gpu.mem_info()[0] if self.gpu else 0
        return plan

    def reserved(self):
        """VRAM the dense part holds before the FFN gets any: {} when it runs on the CPU."""
        if self.dense != "gpu":
            return {}
        return {"dense weights": self.dense_weight_bytes, "KV cache": self.kv_bytes, "scratch": placement.DENSE_SCRATCH}

    def report(self, plan):
        """Planned against allocated VRAM, once the hot neurons are in place."""
        if self.gpu is None:
            return
        used = self._free_before - self.gpu.mem_info()[0]
        mib = lambda b: f"{b / 2**20:,.1f} MiB"     # noqa: E731
        dense = sum(self.reserved().values())
        said = (f"; dense part: planned {mib(dense)}, the device's free memory fell by "
                f"{mib(self.dense_measured)} while ONNX Runtime loaded it" if dense else "")
        self.notes.append(Note(f"VRAM: FFN hot neurons planned {mib(plan.total - dense)}, allocated "
                               f"{mib(self.gpu.allocated)} (the device's free memory fell by {mib(used)}){said}"))

    @staticmethod
    def release(ffns):
        """Return the GPU memory of the layers' hot halves (before a new plan)."""
        for entry in ffns or []:
            hot = getattr(entry.kernel, "hot", None) if entry else None
            if hasattr(hot, "close"):
                hot.close()
