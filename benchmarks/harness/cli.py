"""`python -m benchmarks run SUITE [options]` and `python -m benchmarks render`.

    python -m benchmarks run decode  [--model GGUF] [--pinf PINF] [--threads 1,2] [--repeats 5]
                                     [--llama-python PY] [--isa avx2] [--tokens 128] [--q4-0] ...
    python -m benchmarks run prompt  [... --tokens 100]
    python -m benchmarks run memory  [... --loads 3 --tokens 8 --mmap --no-mmap --pause S]
    python -m benchmarks run quality [... --chunks 16 --ctx 512]
    python -m benchmarks render      # docs/benchmarks.md and its plots from benchmarks/results/

Run from the checkout's root. `run` writes benchmarks/results/SUITE-MODEL-DATE.json (--out for another folder) and prints the
table render makes of it. --model defaults to SmolLM2-135M-Instruct.Q4_1.gguf in the model cache
(~/.cache/pinfer, or $PINFER_MODEL_CACHE); without --pinf pinfer runs a dense conversion made on
the spot (`--sparsity none`). Without --llama-python llama.cpp's rows say it was not available.
"""

import argparse
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

from . import RESULTS, decode, memory, prompt, protocol, quality, record

SUITES = {"decode": decode, "prompt": prompt, "memory": memory, "quality": quality}
THREADS = {"decode": "1,2", "prompt": "1,2", "memory": "2", "quality": "2"}
LLAMA_DEFAULT_UBATCH = 512      # llama-cpp-python's n_ubatch unless told (capped at n_batch, here the context)


def model_cache():
    return Path(os.environ.get("PINFER_MODEL_CACHE") or Path.home() / ".cache" / "pinfer")


def _common(p, suite):
    p.add_argument("--model", type=Path, default=model_cache() / "SmolLM2-135M-Instruct.Q4_1.gguf",
                   help="the GGUF llama.cpp runs (default: SmolLM2-135M-Instruct.Q4_1.gguf in the model cache)")
    p.add_argument("--pinf", type=Path, default=None,
                   help="its conversion, which pinfer runs (default: a dense conversion made on the spot)")
    p.add_argument("--threads", default=THREADS[suite], help=f"comma-separated (default {THREADS[suite]})")
    p.add_argument("--llama-python", default=None, help="python of an environment with llama-cpp-python")
    p.add_argument("--llama-ubatch", type=int, default=None, help="llama.cpp's n_ubatch (default: the suite's)")
    p.add_argument("--isa", default=None, help="force pinfer's kernels onto this instruction set (portable, avx2, "
                   "avx512): the AVX2 path on an AVX-512 CPU")
    p.add_argument("--out", type=Path, default=RESULTS, help="the folder of result files (default benchmarks/results)")
    if suite in ("decode", "prompt"):
        p.add_argument("--repeats", type=int, default=5, help="alternating runs per row (at least 5)")
        p.add_argument("--settle", type=float, default=protocol.SETTLE_S, help=argparse.SUPPRESS)


def parser():
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="measure one suite and write its result file")
    suites = run.add_subparsers(dest="suite", required=True)
    for name, mod in SUITES.items():
        p = suites.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        _common(p, name)
        mod.add_arguments(p)
    r = sub.add_parser("render", help="docs/benchmarks.md and its plots from the result files")
    r.add_argument("--check", action="store_true", help="only say whether docs/benchmarks.md is up to date (exit 1 if not)")
    side = sub.add_parser("side-memory")        # the memory suite's pinfer process
    side.add_argument("pinf")
    for opt in ("--threads", "--ctx", "--tokens"):
        side.add_argument(opt, type=int, required=True)
    side.add_argument("--map", choices=["auto", "on", "off"], default="auto")
    side.add_argument("--isa", default=None)
    return ap


def _pinf_maker(a, rec, tmp):
    """pinf_of(gguf): the .pinf pinfer runs for a GGUF (--pinf for --model, else a dense conversion
    in `tmp`), recorded in rec["models"]."""
    def pinf_of(gguf):
        if a.pinf and gguf == a.model:
            pinf, how = a.pinf, "given (--pinf)"
        else:
            from pinfer.converter.convert import ConvertOptions, convert
            from pinfer.converter.passes import DENSE
            pinf, how = Path(tmp) / f"{gguf.stem}.pinf", "converted on the spot (--sparsity none)"
            with contextlib.redirect_stderr(io.StringIO()):
                convert(ConvertOptions(gguf, pinf, passes=DENSE))
        rec["models"].append({"gguf": record.file_info(gguf), "pinf": {**record.file_info(pinf), "how": how}})
        return pinf
    return pinf_of


def run_suite(a, argv):
    from pinfer import kernels
    if a.isa and a.isa not in kernels.ISAS:
        raise SystemExit(f"--isa is one of {', '.join(kernels.ISAS)}")
    if a.isa:
        kernels.sparse_isa(a.isa)
    if getattr(a, "repeats", protocol.MIN_REPEATS) < protocol.MIN_REPEATS:
        raise SystemExit(f"--repeats is at least {protocol.MIN_REPEATS}: fewer alternations do not give a median "
                         "worth a ratio")
    for path in (a.model, a.pinf):
        if path is not None and not path.is_file():
            raise SystemExit(f"no such file: {path}")
    a.threads = [int(x) for x in str(a.threads).split(",")]
    rec = record.new(a.suite, [str(x).replace(str(Path.home()), "~") for x in argv])
    rec["versions"] = record.versions(protocol.llama_info(a))
    with tempfile.TemporaryDirectory() as tmp:
        SUITES[a.suite].run(a, rec, _pinf_maker(a, rec, tmp))      # memory and quality set their n_ubatch
    if hasattr(a, "repeats"):
        rec["flags"].update(repeats=a.repeats, settle_s=a.settle)
    rec["flags"].update(threads=a.threads, pinfer_isa=kernels.sparse_isa(), isa_forced=a.isa,
                        llama_n_ubatch=a.llama_ubatch or LLAMA_DEFAULT_UBATCH,
                        llama_n_ubatch_default=a.llama_ubatch is None)
    out = record.write(rec, a.out)
    from .render import record_markdown
    print("\n" + record_markdown(rec, out.name, plot=None))
    print(f"wrote {out}")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.cmd == "run":
        return run_suite(a, argv)
    if a.cmd == "side-memory":
        import json
        print(json.dumps(memory.pinfer_side(a.pinf, a.threads, a.ctx, a.tokens, a.map, a.isa)))
        return 0
    from .render import main as render_main
    return render_main(check=a.check)
