"""docs/benchmarks.md from benchmarks/docs_template.md and the result files under benchmarks/results/.

    python -m benchmarks render            # writes docs/benchmarks.md and docs/img/benchmarks/*.png
    python -m benchmarks render --check    # exit 1 where docs/benchmarks.md is not what render makes

The template is the page's prose. A line `{{results SUITE}}` becomes every measured result file
of that suite (origin "measured"), oldest first, each with the line that gives its commit, machine,
versions and flags, its table and its plot; a line `{{transcribed ID}}` becomes the transcribed
record of that id (origin "transcribed": a table of the hand-written page from before the harness,
whose raw runs were not kept), with its machine and commit. Every result file must appear once,
and every placeholder must find its records. The same files give the same bytes: nothing here
reads the clock or the machine it runs on.
"""

import json
import re
import sys
from pathlib import Path

from . import DOC, IMAGES, RESULTS, ROOT, TEMPLATE
from .record import NOT_AVAILABLE

PLACEHOLDER = re.compile(r"^\{\{(results|transcribed) ([\w.-]+)\}\}$")
LINK = "img/benchmarks"         # IMAGES as docs/benchmarks.md links it
GB = 1e9


def load(folder=RESULTS):
    """[(path relative to the repository or the folder, record)] of every *.json under folder, in
    name order."""
    folder = Path(folder)
    out = []
    for path in sorted(folder.rglob("*.json")):
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.relative_to(folder)
        rec = json.loads(path.read_text())
        if not isinstance(rec, dict) or "suite" not in rec:
            raise SystemExit(f"{rel.as_posix()} is not a result of `python -m benchmarks run` (no suite): "
                             "move it out of the results folder")
        out.append((rel.as_posix(), rec))
    return out


# ---- the line above each measured table ----

def provenance(rec, name):
    """Commit, machine, versions and flags of a measured record, in one paragraph."""
    c, m, v, f = rec["commit"], rec["machine"], rec["versions"], rec["flags"]
    dirty = f" with uncommitted changes (diff {c['diff_sha256']})" if c.get("dirty") else ""
    if v.get("llama_cpp_python"):
        llama = (f"llama.cpp through llama-cpp-python {v['llama_cpp_python']}, n_ubatch {f.get('llama_n_ubatch')}"
                 f"{' (its default)' if f.get('llama_n_ubatch_default') else ''}, built with "
                 f"`{v.get('llama_cpp_system_info', '')}`")
    else:
        llama = f"llama.cpp: {v.get('llama_cpp_failed', 'not run')}"
    isa = f"{f.get('pinfer_isa')}" + (" (forced)" if f.get("isa_forced") else "")
    models = "; ".join(f"`{x['gguf']['name']}` ({x['gguf']['bytes'] / 1e6:.1f} MB, sha256 {x['gguf']['sha256']}), "
                       f"pinfer's file {x['pinf']['how']}" for x in rec["models"])
    return (f"**Measured {rec['date'][:10]} at `{c['short']}`{dirty}, on {m['summary']} ({m['kernel']}).** "
            f"`{rec['command']}`. pinfer {v.get('pinfer')} (kernels' ISA {isa}; Python {v.get('python')}, "
            f"NumPy {v.get('numpy')}, ONNX Runtime {v.get('onnxruntime')}); {llama}. "
            f"Threads {', '.join(map(str, f.get('threads', [])))}. Model: {models or '—'}. Record: `{name}`.")


# ---- cells ----

def rate(cell, digits=1):
    if cell is None:
        return "—"
    if "failed" in cell:
        return cell["failed"] if cell["failed"] == NOT_AVAILABLE else f"failed: {cell['failed']}"
    return f"{cell['median']:.{digits}f} ({cell['min']:.{digits}f}-{cell['max']:.{digits}f})"


def scaled(cell, scale=1.0, digits=2):
    if not cell:
        return "—"
    return (f"{cell['median'] * scale:.{digits}f}" if cell["min"] == cell["max"] else
            f"{cell['median'] * scale:.{digits}f} ({cell['min'] * scale:.{digits}f}-{cell['max'] * scale:.{digits}f})")


def ratio(x):
    return "—" if x is None else f"{x:.2f}x"


def table(head, rows, align=None):
    """Markdown table lines; an empty cell is "| |"."""
    def line(cells):
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"
    return [line(head), line(align or ["---"] * len(head))] + [line(r) for r in rows]


# ---- one table per suite ----

def repeats(rec):
    """The alternating runs per row: the flag, or (in records from before it) the runs of a row."""
    if rec["flags"].get("repeats"):
        return rec["flags"]["repeats"]
    return max([c["n"] for r in rec["rows"] for c in (r.get("pinfer"), r.get("llama.cpp")) if c and "n" in c] or ["?"])


def decode_table(rec):
    bw = rec.get("bandwidth_bytes_per_s", {})
    f = rec["flags"]
    lead = (f"Greedy decode of {f.get('tokens')} tokens after the prompt \"{f.get('prompt')}\", both engines one "
            f"token per call{', pinfer fed wikitext-2 tokens' if f.get('feed_text') else ''}; median (min-max) of "
            f"{repeats(rec)} alternating runs per row; read "
            "bandwidth " + ", ".join(f"{b / GB:.1f} GB/s on {t} thread{'s' * (t != '1')}" for t, b in bw.items()) + ".")

    def rows_read(r):
        gu, down = r.get("rows_read") or (None, None)
        return "—" if gu is None else "all" if gu == down == 1.0 else f"{gu:.1%} gate/up, {down:.1%} down"

    def opt(x, fmt):
        return "—" if x is None else format(x, fmt)
    rows = [[r["model"], r["threads"], rate(r["pinfer"]), rate(r["llama.cpp"]), ratio(r["ratio"]), rows_read(r),
             opt(r.get("mb_per_token"), ".1f"), opt(r.get("bound_tok_s"), ".0f"), opt(r.get("share_of_bound"), ".0%")]
            for r in rec["rows"]]
    head = ["model", "threads", "pinfer tok/s", "llama.cpp tok/s", "ratio", "FFN rows read", "MB read/token",
            "bound tok/s", "pinfer / bound"]
    return [lead, ""] + table(head, rows, ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"])


def prompt_table(rec):
    f = rec["flags"]
    lead = (f"A {f.get('tokens')}-token prompt of {f.get('text')} from an empty cache; median (min-max) of "
            f"{repeats(rec)} alternating runs per row, after a warm-up of each engine.")
    rows = [[r["model"], r["threads"], rate(r["pinfer"]), rate(r["llama.cpp"]), ratio(r["ratio"]), r["route"] or "—"]
            for r in rec["rows"]]
    return [lead, ""] + table(["model", "threads", "pinfer tok/s", "llama.cpp tok/s", "ratio", "pinfer's route"], rows,
                              ["---", "---:", "---:", "---:", "---:", "---"])


def memory_table(rec):
    f = rec["flags"]
    lead = (f"Each load in a fresh process, the engines alternating, {f.get('loads')} loads each, n_ctx {f.get('ctx')}, "
            f"{f.get('tokens')} decode tokens after it; medians (range).")
    rows = []
    for r in rec["rows"]:
        if r.get("load_s") is None:
            rows.append([r["model"], r["threads"], r["engine"], f"failed: {r.get('failed')}"] + ["—"] * 6)
            continue
        failed = [x for x in r.get("loads", []) if "error" in x]
        engine = r["engine"] + (f" ({len(failed)} of {len(r['loads'])} loads failed: {failed[0]['error']})"
                                if failed else "")
        rows.append([r["model"], r["threads"], engine, scaled(r["load_s"]), scaled(r["VmRSS"], 1 / GB),
                     scaled(r["RssAnon"], 1 / GB), scaled(r["VmHWM"], 1 / GB), scaled(r["peak_after_decode"], 1 / GB),
                     scaled(r["tok_s"]), scaled(r["expected_bytes"], 1 / GB)])
    head = ["model", "threads", "engine", "load s", "RSS after load GB", "anonymous GB", "peak during load GB",
            "peak after decode GB", "decode tok/s", "expected GB"]
    out = [lead, ""] + table(head, rows, ["---", "---:", "---"] + ["---:"] * 7)
    loads = {(r["threads"], r["engine"]): r["load_s"] for r in rec["rows"] if r.get("load_s")}
    for t in rec["flags"].get("threads", []):
        if (t, "pinfer") in loads and (t, "llama.cpp") in loads:
            out += ["", f"Load time pinfer / llama.cpp on {t} thread(s): "
                        f"{loads[(t, 'pinfer')]['median'] / loads[(t, 'llama.cpp')]['median']:.2f}x (medians)."]
    kv = rec.get("kv_f16_bytes", {})
    if kv:
        out += ["", "KV cache in f16: " + ", ".join(f"{b / GB:.3f} GB at {n} tokens" for n, b in kv.items()) + "."]
    return out


def quality_table(rec):
    f = rec["flags"]
    lead = (f"Perplexity on {f.get('text')}, {f.get('ctx')}-token chunks, the second half of each scored, "
            f"{f.get('chunks')} chunks (llama.cpp's protocol on both sides).")
    rows = []
    for r in rec["rows"]:
        if "failed" in r:
            rows.append([r["model"], r["engine"], r["threads"], f"failed: {r['failed']}", "—", "—", "—", "—"])
        else:
            rows.append([r["model"], r["engine"], r["threads"], f"{r['ppl']:.4f}", f"{r['stderr']:.4f}", r["chunks"],
                         r["tokens"], f"{r['seconds']:.1f}"])
    out = [lead, ""] + table(["model", "engine", "threads", "perplexity", "±", "chunks", "tokens scored", "seconds"],
                             rows, ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"])
    ratios = [f"{r['ratio']:.4f} on {r['threads']} thread(s)" for r in rec["rows"] if r.get("ratio")]
    return out + (["", "pinfer / llama.cpp perplexity: " + ", ".join(ratios) + "."] if ratios else [])


TABLES = {"decode": decode_table, "prompt": prompt_table, "memory": memory_table, "quality": quality_table}


def failures(rec):
    """The failures no table row shows (a quantization that failed, ...), one line each."""
    shown = {(r.get("engine"), r.get("threads")) for r in rec["rows"] if "failed" in r} | \
        {(e, r.get("threads")) for r in rec["rows"] for e in ("pinfer", "llama.cpp")
         if isinstance(r.get(e), dict) and "failed" in r[e]}
    left = [f for f in rec["failures"] if (f["engine"], f.get("threads")) not in shown]
    return [f"- {f['engine']} failed ({f.get('model')}): {f['reason']}" for f in left]


def record_markdown(rec, name, plot):
    """A measured record as markdown: provenance, table, failures, plot link."""
    out = [provenance(rec, name), ""] + TABLES[rec["suite"]](rec)
    more = failures(rec)
    if more:
        out += [""] + more
    if plot:
        out += ["", f"![{rec['suite']}: pinfer against llama.cpp, at {rec['commit']['short']} on "
                    f"{rec['machine']['cpu']}]({LINK}/{plot})"]
    return "\n".join(out)


def transcribed_markdown(rec):
    where = rec["machine"]
    when = rec["commit"]
    note = (f"*Transcribed from the hand-written page (the raw runs were not kept). Machine: {where}. "
            f"Commit: {when}.*")
    return "\n".join([note, ""] + table(rec["columns"], rec["rows"], rec.get("align")))


def render(results=RESULTS, template=TEMPLATE, images=IMAGES):
    """The page's markdown; the plots written into `images` (stale ones there removed)."""
    from . import plots
    records = load(results)
    measured = {}
    transcribed = {}
    for name, rec in records:
        if rec.get("origin") == "transcribed":
            if rec["id"] in transcribed:
                raise ValueError(f"two transcribed records with the id {rec['id']}")
            transcribed[rec["id"]] = (name, rec)
        else:
            measured.setdefault(rec["suite"], []).append((name, rec))
    images = Path(images)
    images.mkdir(parents=True, exist_ok=True)
    written, used, out = set(), set(), []
    for line in Path(template).read_text().splitlines():
        m = PLACEHOLDER.match(line.strip())
        if not m:
            out.append(line)
            continue
        kind, key = m.groups()
        if kind == "transcribed":
            if key not in transcribed:
                raise ValueError(f"the template's {{{{transcribed {key}}}}} has no record under {results}")
            used.add(transcribed[key][0])
            out.append(transcribed_markdown(transcribed[key][1]))
            continue
        group = sorted(measured.get(key, []), key=lambda nr: (nr[1]["date"], nr[0]))
        if not group:
            out.append(f"*No measured `{key}` result yet: `python -m benchmarks run {key}` writes one.*")
        for i, (name, rec) in enumerate(group):
            png = plots.plot(rec, images, Path(name).stem)
            written.add(png)
            used.add(name)
            out += ([""] if i else []) + [record_markdown(rec, name, png)]
    unused = [n for n, _ in records if n not in used]
    if unused:
        raise ValueError("result files the template does not place: " + ", ".join(unused))
    for stale in images.glob("*.png"):
        if stale.name not in written:
            stale.unlink()
    return "\n".join(out) + "\n"


def main(check=False):
    if check:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            fresh = render(images=tmp)
        same = DOC.read_text() == fresh
        print(f"{DOC.relative_to(ROOT)} is {'up to date' if same else 'not what render makes: python -m benchmarks render'}")
        return 0 if same else 1
    DOC.write_text(render())
    print(f"wrote {DOC.relative_to(ROOT)} and {IMAGES.relative_to(ROOT)}/*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
