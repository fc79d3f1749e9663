"""Crafted `.pinf` files: a generator of hostile header edits that keep every checksum valid, and a
worker that loads each crafted file and generates from it, reporting one JSON line per case.

A case is a seed: the same seed crafts the same file from the same source, so a failure found by
`make fuzz` is replayed with `python tests/craft.py SOURCE.pinf SEED`. The worker runs in its own
process so that a crash (a segfault in a kernel fed a crafted shape) is a finding, not a dead test
run: the parent sees which case was running when the process ended.

Each edit keeps the file a valid container (the reader's directory checks pass or fail as they
would on any file): it changes what the header *says* the model is, the way a stranger would
who edits a file by hand, so that the checks between the header and the runtime are what is tested.
"""

import hashlib
import json
import math
import random
import sys
import traceback
from pathlib import Path

# Integer config fields and values inside the reader's bounds (formats/config.py) that real
# models never pair with the file's tensors.
INT_FIELDS = ("n_layer", "d_model", "n_ff", "n_head", "n_head_kv", "head_dim", "vocab", "n_ctx_train",
              "rotary_dim", "sliding_window", "sliding_pattern")
FLOAT_FIELDS = ("norm_eps", "rope_base", "rope_linear_scale", "ffn_act_threshold", "embed_scale",
                "attn_scale", "attn_softcap", "final_softcap", "rope_base_local")
CHOICES = {"ffn_act": ("silu", "relu", "drelu", "fatrelu", "gelu"), "norm": ("rms", "layer"),
           "positions": ("rope", "learned")}
BOOLS = ("rope_interleaved", "tied_embeddings", "ffn_gated")
FORMATS = ("q4", "q5", "q8", "q4r", "q8r", "f16", "f32")
DTYPES = {"u8": 1, "i8": 1, "i32": 4, "f16": 2, "f32": 4}


def _int_value(rng, old):
    return rng.choice([1, 2, 3, 7, 8, 16, 31, 32, 33, 64, 96, 128, 256, 4096, max(1, old // 2), old * 2, old + 1,
                       max(1, old - 1)])


def _reshape(rng, e):
    """A shape with the same number of elements as entry e's (the directory stays consistent)."""
    n = math.prod(e["shape"])
    splits = [d for d in (2, 4, 8, 16, 32, 64) if n % d == 0]
    if not splits or rng.random() < 0.3:
        return [n]
    d = rng.choice(splits)
    return rng.choice([[d, n // d], [n // d, d], [1, n], [n, 1], [1, 1, n]])


def _retype(rng, e):
    """The same bytes under another dtype: shape scaled so that nbytes still matches."""
    size = DTYPES[e["dtype"]]
    options = [t for t, s in DTYPES.items() if t != e["dtype"] and (e["nbytes"] // s) * s == e["nbytes"]]
    if not options:
        return None
    t = rng.choice(options)
    return t, [e["nbytes"] // DTYPES[t]] if size != DTYPES[t] else list(e["shape"])


def mutate(rng, header):
    """Apply 1 to 3 random edits to `header` in place; returns what was done, in words."""
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.choice(["config", "config", "choice", "float", "tensor_shape", "tensor_type", "tensor_drop",
                           "format", "format_drop", "layers", "tokenizer", "hot_rows"])
        cfg, tensors = header["config"], header["tensors"]
        if kind == "config":
            f = rng.choice(INT_FIELDS)
            cfg[f] = _int_value(rng, int(cfg.get(f, 1) or 1))
            done.append(f"config.{f}={cfg[f]}")
        elif kind == "choice":
            f = rng.choice(list(CHOICES) + list(BOOLS))
            cfg[f] = rng.choice(CHOICES[f]) if f in CHOICES else not cfg.get(f, False)
            done.append(f"config.{f}={cfg[f]}")
        elif kind == "float":
            f = rng.choice(FLOAT_FIELDS)
            cfg[f] = rng.choice([1e-30, 1e-12, 0.5, 1.0, 3.0, 1e6, 1e30, 3.4e38])
            done.append(f"config.{f}={cfg[f]}")
        elif kind in ("tensor_shape", "tensor_type", "tensor_drop"):
            name = rng.choice(sorted(tensors))
            e = tensors[name]
            if kind == "tensor_drop":
                del tensors[name]
            elif kind == "tensor_shape":
                e["shape"] = _reshape(rng, e)
            else:
                new = _retype(rng, e)
                if new is None:
                    continue
                e["dtype"], e["shape"] = new
            done.append(f"{kind} {name}" + (f" -> {e['dtype']} {e['shape']}" if kind != "tensor_drop" else ""))
        elif kind in ("format", "format_drop"):
            base = rng.choice(sorted(header["weights"]))
            if kind == "format_drop":
                del header["weights"][base]
            else:
                header["weights"][base] = rng.choice(FORMATS)
            done.append(f"{kind} {base}" + (f" -> {header['weights'][base]}" if kind == "format" else ""))
        elif kind == "layers" and header["layers"]:
            i = rng.randrange(len(header["layers"]))
            header["layers"][i] = {"mode": rng.choice(["dense", "down", "predicted", "relu"]),
                                   "value": rng.choice([0.0, 0.3, 0.99, 1.0, 7.0])}
            done.append(f"layers[{i}]={header['layers'][i]}")
        elif kind == "tokenizer":
            tok = header["tokenizer"]
            key = rng.choice(["bos_id", "eos_id", "merges", "pre", "chat_template", "token_type", "model", "hf_tokenizer"])
            tok[key] = rng.choice([-1, 10 ** 9, None, "x", "{not json", [], [1, 2], {"a": 1}])
            done.append(f"tokenizer.{key}={tok[key]!r}")
        elif kind == "hot_rows":
            header["ffn"]["hot_rows"] = [rng.choice([0, 1, 10 ** 6, -5]) for _ in range(rng.choice([1, 2, 5]))]
            done.append(f"ffn.hot_rows={header['ffn']['hot_rows']}")
    return "; ".join(done) or "nothing"


def craft(source, seed, out):
    """Write the crafted file for `seed` at `out` (every checksum valid); returns what was done."""
    from pinfer.formats import schema as S

    data = bytearray(Path(source).read_bytes())
    magic, ver, res, off, length, _ = S.PREAMBLE.unpack(bytes(data[:S.PREAMBLE.size]))
    header = json.loads(bytes(data[off:off + length]))
    what = mutate(random.Random(seed), header)
    blob = json.dumps(header).encode()
    data = data[:off] + blob
    data[:S.PREAMBLE.size] = S.PREAMBLE.pack(magic, ver, res, off, len(blob), hashlib.sha256(blob).digest())
    Path(out).write_bytes(bytes(data))
    return what


def run_case(path):
    """Load the file and generate 3 tokens, as `pinfer generate` does: "ok", or the refusal."""
    from pinfer.runtime.generate import GenerateOptions, Session
    from pinfer.runtime.model import RuntimeOptions

    session = Session(path, RuntimeOptions(threads=1, n_ctx=64))
    ids = session.tokenizer.encode("hello world")
    for _ in session.generate(ids, GenerateOptions(n_predict=3)):
        pass
    return "ok"


def main(source, seeds, workdir):
    """One JSON line per seed on stdout: {"seed", "what", "outcome", "message"}; outcome is ok,
    refused (a ValueError-family or OSError sentence, as the CLI prints) or traceback."""
    for seed in seeds:
        out = Path(workdir) / f"crafted-{seed}.pinf"
        what = craft(source, seed, out)
        print(json.dumps({"seed": seed, "what": what, "outcome": "started"}), flush=True)
        try:
            outcome, message = run_case(out), ""
        except (ValueError, OSError) as e:
            outcome, message = "refused", str(e)
        except Exception as e:      # noqa: BLE001 - every other escape is the finding
            outcome, message = "traceback", "".join(traceback.format_exception(e))[-2000:]
        print(json.dumps({"seed": seed, "what": what, "outcome": outcome, "message": message}), flush=True)
        out.unlink()


if __name__ == "__main__":
    if len(sys.argv) == 3:          # replay one case
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            main(sys.argv[1], [int(sys.argv[2])], d)
    else:
        main(sys.argv[1], [int(s) for s in sys.argv[3].split(",")], sys.argv[2])
