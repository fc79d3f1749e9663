import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory on sys.path. From the repository root that makes
# its top-level folders (runtime/, formats/, cli/, ...) importable under those bare names, which
# could hide an installed package of the same name (the kernels once sat in a top-level kernels/
# and hid Hugging Face's `kernels` package from transformers; they live in pinfer/kernels/ now).
# pinfer itself is imported through its installed (editable) package.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]
sys.path.insert(0, str(Path(__file__).parent))
