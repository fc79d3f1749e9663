"""Prompt (prefill) speed of pinfer against llama.cpp: `python -m benchmarks run prompt` under its
former name, with the same options (--model, --pinf, --llama-python, --tokens, --threads,
--repeats). The protocol: benchmarks/harness/prompt.py and protocol.py.

    python benchmarks/prompt_vs_llamacpp.py --model MODEL.gguf --pinf MODEL.pinf \
        --llama-python .venv-llama/bin/python [--tokens 100] [--threads 1,2] [--repeats 5]
"""

import sys

from harness.cli import main  # benchmarks/ is on sys.path (benchmarks/__init__.py)

if __name__ == "__main__":
    sys.exit(main(["run", "prompt", *sys.argv[1:]]))
