"""Whether a change kept pinfer's behaviour and speed: the same measurements on a git revision and
on the working tree, in one run, alternating.

    python benchmarks/compare_revisions.py REV --model SmolLM2.pinf [--text tests/data/wikitext-2-raw-test.txt]
        [--threads 1,2] [--repeats 5] [--pause 0]

REV is checked out into a temporary worktree whose C kernels are the working tree's build where
their sources are the same (copied), else REV's own, built there. Each side runs in its own
process with its own `pinfer` on the path: perplexity over the first 4 chunks of 512 tokens and
64 greedy tokens after a fixed prompt (which must be identical), then decode (--tokens, 128) and
prefill (a --prompt-token prompt, 128) speed, the sides alternating `--repeats` times per thread count;
medians and the ratio are printed.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, WIKITEXT  # benchmarks/ is on sys.path (benchmarks/__init__.py)

PACKAGES = ("formats", "converter", "runtime", "cli")


def kernel_dir(tree):
    """The kernels' folder of a checkout: pinfer/kernels/, or kernels/ at the top in revisions
    before it moved."""
    return tree / "pinfer" / "kernels" if (tree / "pinfer" / "kernels").is_dir() else tree / "kernels"


def same_files(a, b):
    """Whether folders a and b hold the same files with the same bytes."""
    fa = {p.relative_to(a): p for p in a.rglob("*") if p.is_file()}
    fb = {p.relative_to(b): p for p in b.rglob("*") if p.is_file()}
    return fa.keys() == fb.keys() and all(fa[k].read_bytes() == fb[k].read_bytes() for k in fa)

CHILD = r'''
import json, math, sys, time
import numpy as np
from pinfer.runtime.model import Model, RuntimeOptions
from pinfer.runtime.tokenizer import Tokenizer
what, path, threads, text = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
n_decode, n_prompt, act = int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
m = Model(path, RuntimeOptions(threads=threads, n_ctx=512, device="cpu",
                               **({"activation": act, "kernels": "on", "sparsity": "dense"} if act else {})))
tok = Tokenizer.from_spec(m.tokenizer_spec)
ids = tok.encode(open(text, encoding="utf-8").read()[:200000])
if what == "quality":
    nll = []
    for c in range(4):
        chunk = ids[c * 512:(c + 1) * 512]
        m.reset()
        logits = m.forward(chunk, logits_from=0)
        z = logits[255:511].astype(np.float64)
        lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
        nll.append(lse - z[np.arange(len(z)), chunk[256:512]])
    m.reset()
    out, t = [], m.forward(ids[:16])[-1]
    for _ in range(64):
        out.append(int(t.argmax()))
        t = m.forward([out[-1]])[-1]
    print(json.dumps({"ppl": math.exp(float(np.concatenate(nll).mean())), "greedy": out}))
else:
    m.reset(); m.forward(ids[:8])
    for _ in range(8):
        m.forward([1])
    m.reset(); m.forward(ids[:8])
    t0 = time.perf_counter()
    for k in range(n_decode):
        m.forward([ids[8 + k]])
    decode = n_decode / (time.perf_counter() - t0)
    m.reset(); m.forward(ids[:n_prompt])
    m.reset()
    t0 = time.perf_counter()
    m.forward(ids[:n_prompt])
    print(json.dumps({"decode": decode, "prefill": n_prompt / (time.perf_counter() - t0)}))
'''


def pyroot(tree, dest):
    """A `pinfer` package of symlinks to tree's folders (what `pip install -e .` maps)."""
    pkg = dest / "pinfer"
    pkg.mkdir(parents=True)
    for name in PACKAGES:
        (pkg / name).symlink_to(tree / name)
    (pkg / "kernels").symlink_to(kernel_dir(tree))
    for f in (tree / "pinfer").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    return dest


def run(root, what, a, threads):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", CHILD, what, str(a.model), str(threads), str(a.text), str(a.tokens),
                          str(a.prompt), str(a.activation)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--text", type=Path, default=WIKITEXT)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--speed-only", action="store_true", help="skip perplexity and greedy (large models)")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens timed")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens timed")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds idle before each speed run (default 0): on a virtual machine that hands freed "
                         "memory back to its host, a run that starts while the previous process's memory is being "
                         "handed back decodes more slowly")
    ap.add_argument("--activation", type=float, default=0.0, metavar="S",
                    help="both sides at activation sparsity S (the file needs its thresholds, and REV must "
                         "have RuntimeOptions.activation: 211c001 or later)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        old = tmp / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), a.rev], check=True,
                       capture_output=True)
        try:
            if same_files(kernel_dir(old) / "csrc", kernel_dir(ROOT) / "csrc"):
                for so in kernel_dir(ROOT).glob("_kernels*.so"):
                    shutil.copy(so, kernel_dir(old) / so.name)
            else:       # the revision's own kernels, built in its worktree with the same compiler and flags
                print(f"the C kernels differ: building {a.rev}'s", file=sys.stderr)
                subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=old, check=True,
                               capture_output=True)
            roots = {"before": pyroot(old, tmp / "root-old"), "after": pyroot(ROOT, tmp / "root-new")}
            same = True
            if not a.speed_only:
                q = {side: run(root, "quality", a, 1) for side, root in roots.items()}
                same = q["before"] == q["after"]
                print(f"{a.rev} against the working tree, {a.model.name}: perplexity {q['before']['ppl']:.6f} before, "
                      f"{q['after']['ppl']:.6f} after; 64 greedy tokens {'identical' if same else 'DIFFERENT'}")
            print("\n| threads | measure | before (median, range) | after (median, range) | after / before |")
            print("| ---: | --- | ---: | ---: | ---: |")
            for threads in [int(t) for t in a.threads.split(",")]:
                runs = {"before": [], "after": []}
                for r in range(a.repeats):
                    for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                        time.sleep(a.pause)
                        runs[side].append(run(roots[side], "speed", a, threads))
                for key in ("decode", "prefill"):
                    b, f = ([x[key] for x in runs[s]] for s in ("before", "after"))
                    mb, mf = statistics.median(b), statistics.median(f)
                    print(f"| {threads} | {key} tok/s | {mb:.1f} ({min(b):.1f}-{max(b):.1f}) | "
                          f"{mf:.1f} ({min(f):.1f}-{max(f):.1f}) | {mf / mb:.3f} |")
            return 0 if same else 1
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
