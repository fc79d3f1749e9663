"""Decode speed of pinfer against llama.cpp: `python -m benchmarks run decode` under its former
name, with the same options (--model, --pinf, --llama-python, --q4-0, --threads, --tokens,
--repeats, --isa, --feed-text, --activation). The protocol: benchmarks/harness/decode.py and
protocol.py. It writes its result file under benchmarks/results/ as the harness does.

    python benchmarks/smollm2_vs_llamacpp.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-python .venv-llama/bin/python [--q4-0] [--pinf converted.pinf] [--threads 1,2]
"""

import sys

from harness.cli import main  # benchmarks/ is on sys.path (benchmarks/__init__.py)

if __name__ == "__main__":
    sys.exit(main(["run", "decode", *sys.argv[1:]]))
