import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory on sys.path. From the repository root that makes
# its top-level folders (kernels/, runtime/, formats/, ...) importable as packages of those names
# and hides installed ones: transformers 5 imports Hugging Face's `kernels` package and found
# kernels/ here instead. pinfer itself is imported through its installed (editable) package.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]
sys.path.insert(0, str(Path(__file__).parent))
