"""The plots docs/benchmarks.md shows, one PNG per measured record (matplotlib's Agg backend). Each
carries its record's commit, machine and date in its footer. No timestamp or version goes into
the file, so the same record gives the same bytes (with the same matplotlib)."""

from pathlib import Path

COLORS = {"pinfer": "#1f77b4", "llama.cpp": "#ff7f0e"}


def _figure(rec, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=100)
    c, v = rec["commit"], rec["versions"]
    footer = (f"pinfer at {c['short']}{' + uncommitted changes ' + c['diff_sha256'] if c.get('dirty') else ''}, "
              f"{rec['date'][:10]}; llama-cpp-python {v.get('llama_cpp_python') or 'not run'}\n{rec['machine']['summary']}")
    fig.suptitle(title, fontsize=11)
    fig.text(0.01, 0.01, footer, fontsize=7, va="bottom", ha="left", color="#444444")
    return plt, fig, ax


def _save(plt, fig, folder, stem):
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    name = f"{stem}.png"
    fig.savefig(Path(folder) / name, metadata={"Software": None})
    plt.close(fig)
    return name


def _bars(ax, labels, cells, unit):
    """Two bars per label (pinfer, llama.cpp): median, whiskers at min and max; a failed engine's
    bar is a note instead."""
    width = 0.38
    for j, engine in enumerate(("pinfer", "llama.cpp")):
        for i, row in enumerate(cells):
            x = i + (j - 0.5) * width
            cell = row.get(engine)
            if cell and "median" in cell:
                ax.bar(x, cell["median"], width, color=COLORS[engine], label=engine if i == 0 else None,
                       yerr=[[cell["median"] - cell["min"]], [cell["max"] - cell["median"]]], capsize=3)
            else:
                ax.text(x, 0, "failed" if cell else "not run", rotation=90, ha="center", va="bottom", fontsize=8,
                        color=COLORS[engine])
                ax.bar(x, 0, width, color=COLORS[engine], label=engine if i == 0 else None)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)


def _speed(rec, folder, stem, what):
    plt, fig, ax = _figure(rec, f"{what}: pinfer and llama.cpp, median and range of the alternating runs")
    labels = [f"{r['model'][:40]}\n{r['threads']} thread{'s' * (r['threads'] != 1)}"
              + (f", {r['ratio']:.2f}x" if r.get("ratio") else "") for r in rec["rows"]]
    _bars(ax, labels, rec["rows"], "tokens per second")
    return _save(plt, fig, folder, stem)


def _memory(rec, folder, stem):
    plt, fig, ax = _figure(rec, "Memory: RSS after load (bars) and load seconds (labels), medians")
    rows = [r for r in rec["rows"] if r.get("VmRSS")]
    labels = [f"{r['engine']}\n{r['threads']} thread{'s' * (r['threads'] != 1)}" for r in rows]
    for i, r in enumerate(rows):
        color = COLORS["llama.cpp" if r["engine"] == "llama.cpp" else "pinfer"]
        ax.bar(i, r["VmRSS"]["median"] / 1e9, 0.6, color=color)
        ax.text(i, r["VmRSS"]["median"] / 1e9, f"load {r['load_s']['median']:.2f} s", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("GB")
    return _save(plt, fig, folder, stem)


def _quality(rec, folder, stem):
    plt, fig, ax = _figure(rec, f"Perplexity on {rec['flags'].get('text')} ({rec['flags'].get('chunks')} chunks)")
    for i, r in enumerate(rec["rows"]):
        color = COLORS[r["engine"]]
        if "ppl" in r:
            ax.bar(i, r["ppl"], 0.6, color=color, yerr=r["stderr"], capsize=3)
            ax.text(i, r["ppl"] / 2, f"{r['ppl']:.3f}", ha="center", fontsize=8, color="white")
        else:
            ax.text(i, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=8, color=color)
    ax.set_xticks(range(len(rec["rows"])))
    ax.set_xticklabels([f"{r['engine']}\n{r['threads']} thread{'s' * (r['threads'] != 1)}" for r in rec["rows"]],
                       fontsize=8)
    ax.set_ylabel("perplexity (± its standard error)")
    return _save(plt, fig, folder, stem)


def plot(rec, folder, stem):
    """Write the record's plot as folder/stem.png; its file name."""
    if rec["suite"] == "decode":
        return _speed(rec, folder, stem, "Decode")
    if rec["suite"] == "prompt":
        return _speed(rec, folder, stem, "Prompt")
    if rec["suite"] == "memory":
        return _memory(rec, folder, stem)
    return _quality(rec, folder, stem)
