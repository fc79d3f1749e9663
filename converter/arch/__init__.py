"""Architecture registry: a source architecture name -> the module that maps it (mlx-lm style).

Each module provides `config_from_gguf(meta, tensor_shapes) -> ModelConfig` and `TENSORS`, the
GGUF tensor names it reads, as data."""

import importlib

# source name -> module name in this package
ARCHS = {
    "llama": "llama",
    "mistral": "llama",  # GGUF mistral files that keep their own name are llama-shaped
}


class UnsupportedArchitecture(ValueError):
    pass


def supported():
    return sorted(ARCHS)


def get(name):
    if name not in ARCHS:
        raise UnsupportedArchitecture(
            f"the model's architecture is {name!r}, which pinfer cannot convert; "
            f"supported architectures: {', '.join(supported())}")
    return importlib.import_module(f".{ARCHS[name]}", __name__)
