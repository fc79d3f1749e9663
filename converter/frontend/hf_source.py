"""Hugging Face front end: config.json and memory-mapped *.safetensors (sharded through
model.safetensors.index.json or not), streamed tensor by tensor under the canonical GGUF-style
names the architecture module maps them to, so the passes and the back end see what the GGUF
front end gives them. Floats stay floats: f32 and f16 are carried over exactly, bf16 becomes f16
(f32 for a tensor beyond f16's range)."""

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from pinfer.formats import blocks

from . import arch
from .gguf_source import SourceError, SourceTensor

F16_MAX = 65504.0


def _safetensors_names(path):
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:   # safetensors raises its own error types for damaged files
        raise SourceError(f"{path} could not be read as safetensors ({e}); re-download it") from None


class RowSlice:
    """The transform that offers rows r0:r1 of a Hugging Face tensor (a fused projection's part)."""

    def __init__(self, r0, r1):
        self.r0, self.r1 = r0, r1

    def __call__(self, a):
        return a[self.r0:self.r1]


class HFSource:
    """One Hugging Face model folder. Only config.json is read until `configure`."""

    def __init__(self, path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise SourceError(f"{self.path} has no config.json; pass a Hugging Face model folder or a .gguf file")
        try:
            self.config = json.loads(cfg_path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise SourceError(f"{cfg_path} is not valid JSON ({e}); fix or re-download it") from None
        if not isinstance(self.config, dict):
            raise SourceError(f"{cfg_path} holds a {type(self.config).__name__}, not a JSON object")
        self.meta = {"general.name": self.config.get("_name_or_path") or self.path.name}
        self._map = {}
        self._files = {}

    powerinfer = False          # the GGUF source's interface: no PowerInfer layout here
    down_neuron_major = False

    @property
    def architecture(self):
        t = self.config.get("model_type")
        if not isinstance(t, str):
            raise SourceError(f"{self.path / 'config.json'} has no model_type; it is not a model configuration")
        return t

    def module(self):
        """The architecture module, checked before any tensor is read."""
        return arch.get_hf(self.architecture, self.config.get("architectures") or ())

    def configure(self, mod):
        """The ModelConfig, after indexing the safetensors headers (no tensor data is read)."""
        cfg = mod.config_from_hf(self.config)
        self._files = self._index()
        self._map = {c: m for c, m in mod.hf_tensors(self.config, cfg).items()
                     if m[0] is None or m[0] in self._files}     # None: computed from the config
        if not cfg.tied_embeddings and "output.weight" not in self._map:
            cfg = dataclasses.replace(cfg, tied_embeddings=True)    # no lm_head saved: it is tied
        self._vocab = cfg.vocab
        return cfg

    def _index(self):
        """Hugging Face tensor name -> the safetensors file holding it."""
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise SourceError(f"{index} is not a safetensors index ({e}); re-download the model") from None
            files = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = {}
            for f in sorted(self.path.glob("*.safetensors")):
                for name in _safetensors_names(f):
                    files[name] = f
        if not files:
            pickled = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt"))
            hint = (f" (it has {', '.join(pickled[:3])}: pickled checkpoints can run code when loaded, and "
                    "pinfer does not read them; convert them to safetensors first)") if pickled else ""
            raise SourceError(f"{self.path} has no *.safetensors weights{hint}")
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise SourceError(f"{self.path} lacks the weight files {', '.join(missing[:3])} its index names")
        return files

    def tensor_names(self):
        return set(self._map)

    def _array(self, name):
        if name not in self._map:
            raise SourceError(f"{self.path} lacks the tensor {name}")
        import torch
        from safetensors import safe_open
        hf_name, transform = self._map[name]
        if hf_name is None:
            return transform(None)
        with safe_open(self._files[hf_name], framework="pt") as f:
            t = f.get_tensor(hf_name)
        if t.dtype == torch.bfloat16:
            wide = t.float()
            t = wide.half() if float(wide.abs().max()) <= F16_MAX else wide
        elif t.dtype not in (torch.float16, torch.float32):
            t = t.float()
        a = t.numpy()
        return transform(a) if transform is not None else a

    def tensor(self, name):
        a = self._array(name)
        a = a.reshape(1, -1) if a.ndim == 1 else a.reshape(a.shape[0], -1)
        return SourceTensor(name, Q.F16 if a.dtype == np.float16 else Q.F32, a.shape[0], a.shape[1],
                            np.ascontiguousarray(a))

    def nbytes(self, name):
        """Bytes of the tensor as stored in the source, from the file's header alone."""
        from safetensors import safe_open
        hf_name, transform = self._map[name]
        if hf_name is None:
            return self._array(name).nbytes
        with safe_open(self._files[hf_name], framework="pt") as f:
            s = f.get_slice(hf_name)
            size = {"F32": 4, "F64": 8}.get(s.get_dtype(), 2)
            shape = list(s.get_shape())
            if isinstance(transform, RowSlice):
                shape[0] = transform.r1 - transform.r0
            return size * int(np.prod(shape))

    def ttype(self, name):
        """The GGUF type tensor() gives, from the header: F32 for f32, F16 otherwise (bf16 too,
        unless a value is beyond f16's range, which only reading the data tells)."""
        from safetensors import safe_open
        hf_name, _ = self._map[name]
        if hf_name is None:
            return Q.F32
        with safe_open(self._files[hf_name], framework="pt") as f:
            return Q.F32 if f.get_slice(hf_name).get_dtype() in ("F32", "F64") else Q.F16

    def block(self, name):
        t = self.tensor(name)
        return blocks.from_gguf(t.ttype, t.raw, t.rows, t.k)

    def floats(self, name):
        return self.tensor(name).raw.astype(np.float32, copy=False)

    def release(self):
        """Nothing stays mapped between tensors (each is read on demand)."""

    def sha256(self):
        """One digest over config.json and the weight files, in name order."""
        h = hashlib.sha256()
        for f in [self.path / "config.json", *sorted(set(self._files.values()))]:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
        return h.hexdigest()

    def tokenizer_spec(self):
        from .hf_tokenizer import tokenizer_spec_from_hf
        try:
            return tokenizer_spec_from_hf(self.path, getattr(self, "_vocab", None))
        except ValueError as e:
            raise SourceError(str(e)) from None
