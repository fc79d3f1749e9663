"""The benchmark harness: one protocol for every comparison with llama.cpp, one result format.

    python -m benchmarks run decode|prompt|memory|quality [--model GGUF --pinf PINF ...]
    python -m benchmarks render

`run` measures pinfer against llama.cpp (decode.py, prompt.py, memory.py, quality.py) and writes
one JSON file under benchmarks/results/ (record.py: the machine, the versions, the flags, the
commit, every run's figures, and the failures: an engine that crashes is a row saying so).
`render` makes docs/benchmarks.md from those files and benchmarks/docs_template.md, and the plots
it shows (render.py, plots.py). The decode loop is pinfer's own (pinfer.runtime.bench.decode_rate,
which `pinfer bench` times with too).

This package imports only the standard library at its top: llamacpp_side.py, which runs in
llama-cpp-python's environment (no pinfer there), may import it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
TEMPLATE = BENCHMARKS / "docs_template.md"
DOC = ROOT / "docs" / "benchmarks.md"
IMAGES = ROOT / "docs" / "img" / "benchmarks"
# The one text every benchmark measures quality on, and takes "text tokens" from: the wikitext-2
# test split (raw), which no calibration reads (tests/data/SOURCES.md says where it comes from).
WIKITEXT = ROOT / "tests" / "data" / "wikitext-2-raw-test.txt"
