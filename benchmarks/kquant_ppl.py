"""A K-quant GGUF as people download it, through pinfer and through llama.cpp, in one run.

    python benchmarks/kquant_ppl.py SmolLM2-135M-Instruct.Q4_1.gguf --type Q4_K_M --llama-python .venv-llama/bin/python

1. llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize, allow_requantize) makes
   the --type file from the source; it is kept beside the source and reused.
2. `pinfer convert --sparsity none` converts it (dense: this measures the formats, not sparsity).
3. Printed: each GGUF tensor type and the .pinf format it became, the file sizes, and the
   perplexity of both engines on the wikitext-2 test text (c512, the second half of each chunk
   scored, the first --chunks chunks: llama.cpp's protocol), llama.cpp in its own process with an
   environment of its own (engines.py).
"""

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path

from engines import llamacpp, llamacpp_info, quantize
from harness import WIKITEXT


def gguf_types(path):
    """{GGUF tensor name: type name} from the file's directory."""
    from gguf import GGUFReader
    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def pinf_formats(path):
    from pinfer.formats import PinfReader
    return PinfReader(path).header["weights"]


def role(name):
    for key in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output"):
        if f".{key}." in f".{name}" or name.startswith(key + "."):
            return key
    return "other"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--llama-python", type=Path, required=True, help="a Python with llama-cpp-python")
    ap.add_argument("--text", type=Path, default=WIKITEXT)
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    kq = a.source.with_name(a.source.stem.rsplit(".", 1)[0] + f".{a.type}.gguf")
    if not kq.exists():
        quantize(a.llama_python, a.source, kq, a.type)
    pinf = kq.with_suffix(".pinf")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pinfer", "convert", str(kq), "-o", str(pinf), "--force", "--sparsity", "none"],
                   check=True, capture_output=True)
    convert_s = time.perf_counter() - t0
    types, fmts = gguf_types(kq), pinf_formats(pinf)
    rows = collections.Counter()
    for name, ttype in types.items():
        if name.endswith(".weight") and ttype not in ("F32",):
            base = name[:-len(".weight")]
            r = role(name)
            fmt = {"ffn_gate": "ffn_gate_up", "ffn_up": "ffn_gate_up", "ffn_down": "ffn_down_t",
                   "attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv"}.get(r)
            pname = base.replace(r, fmt) if fmt else base
            rows[(r, ttype, fmts.get(pname, "?"))] += 1
    info = llamacpp_info(a.llama_python)
    print(f"{kq.name}: {kq.stat().st_size / 1e6:.1f} MB GGUF, {pinf.stat().st_size / 1e6:.1f} MB .pinf "
          f"({pinf.stat().st_size / kq.stat().st_size:.3f}x), converted in {convert_s:.1f} s")
    print(f"llama.cpp: llama-cpp-python {info['version']}; {info['system_info']}")
    print("\n| tensor | GGUF type | tensors | .pinf format |\n| --- | --- | ---: | --- |")
    for (r, ttype, fmt), n in sorted(rows.items()):
        print(f"| {r} | {ttype} | {n} | {fmt} |")
    ours = subprocess.run([sys.executable, "-m", "pinfer", "perplexity", str(pinf), "-f", str(a.text), "-c", "512",
                           "--chunks", str(a.chunks), "-t", str(a.threads)], check=True, capture_output=True, text=True)
    ppl_ours = float(ours.stdout.split("PPL = ")[1].split()[0])
    theirs = llamacpp(a.llama_python, "perplexity", kq, a.threads, a.text, ctx=512, chunks=a.chunks)
    print(f"\nperplexity, wikitext-2 test, c512, {theirs['chunks']} chunks ({theirs['tokens']} tokens scored): "
          f"pinfer {ppl_ours:.4f}, llama.cpp {theirs['ppl']:.4f} +/- {theirs['stderr']:.4f}: "
          f"pinfer / llama.cpp = {ppl_ours / theirs['ppl']:.4f}")
    print(json.dumps({"gguf_mb": kq.stat().st_size / 1e6, "pinf_mb": pinf.stat().st_size / 1e6,
                      "ppl_pinfer": ppl_ours, "ppl_llamacpp": theirs["ppl"]}))


if __name__ == "__main__":
    main()
