"""Options and error handling shared by the verbs."""

import contextlib
import resource
import sys
import traceback

import click

from pinfer.formats import PinfFormatError


class UserError(click.ClickException):
    """One sentence for the user; click prints it as `Error: ...` and exits with 1."""


@contextlib.contextmanager
def fail_cleanly(verbose):
    """Turn pinfer's own errors (ValueError family, OSError) into one sentence, or a traceback with -v."""
    try:
        yield
    except (ValueError, OSError, PinfFormatError) as e:
        if verbose:
            traceback.print_exc()
        raise UserError(str(e)) from None


def verbose(ctx):
    return bool(ctx.find_root().obj and ctx.find_root().obj.get("verbose"))


def peak_rss_mb():
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024


def runtime_options(f):
    """-c, -t and the placement options (placement_options) of a verb that loads one model."""
    f = click.option("-c", "--ctx-size", "n_ctx", type=int, default=0, show_default=True,
                     help="Context size in tokens (0: the model's, capped at 4096).")(f)
    f = click.option("-t", "--threads", type=int, default=0, show_default=True,
                     help="CPU threads (0: all cores).")(f)
    return placement_options(f)


def placement_options(f):
    """How the FFN runs and where: --sparsity/--dense, --ffn-kernel, --device, --dense-device,
    --dense-kernel, --vram-budget (pinfer bench takes these, with its own -t list)."""
    f = click.option("--sparsity", default="", metavar="MODE[:VALUE]",
                     help="Override the file's per-layer FFN modes: dense, down:S, predicted:R or relu:R "
                          "(values the converter calibrated; see pinfer inspect).")(f)
    f = click.option("--dense", is_flag=True, help="Compute every FFN neuron (same as --sparsity dense).")(f)
    f = click.option("--ffn-kernel", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
                     is_flag=False, flag_value="on",
                     help="How sparse layers decode: on (pinfer's fused FFN kernel, reading only the rows the "
                          "rule keeps), off (the ONNX graph and the rule over every row), or auto (time both at "
                          "load; keep the kernel where it beats the dense path, run dense elsewhere). "
                          "--ffn-kernel alone means on.")(f)
    f = click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
                     help="Where the FFN's hot neurons run: gpu (hot on an NVIDIA GPU, cold on the CPU; needs "
                          "pinfer[gpu]), cpu, or auto (the GPU when one is found).")(f)
    f = click.option("--dense-device", type=click.Choice(["cpu", "gpu", "auto"]), default="cpu", show_default=True,
                     help="Where attention, norms and the head run: cpu (ONNX Runtime's CPU provider), gpu (its "
                          "CUDA provider in FP16; needs onnxruntime-gpu and --device gpu; not yet run on a GPU "
                          "since its fix, see README.md), or auto (gpu where possible).")(f)
    f = click.option("--dense-kernel", type=click.Choice(["on", "off"]), default="on", show_default=True,
                     help="Where the FFN kernel decodes a layer, run its attention, and the head of each new "
                          "token, through pinfer's C kernels (on; layers of a kind they lack stay on ONNX "
                          "Runtime) or through ONNX Runtime's sessions (off).")(f)
    f = click.option("--kv-type", "-ctk", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
                     help="The KV cache's values: f16 takes half of f32's memory (as llama.cpp's default "
                          "cache, whose -ctk this is too).")(f)
    f = click.option("--mmap/--no-mmap", default=None,
                     help="Where the weights are read from. Default: the file's map (the page cache, as "
                          "llama.cpp does) for large models that pinfer's C kernels run whole, copies in huge "
                          "pages otherwise. --mmap: the map always, with the least memory (a dense layer's "
                          "down projection reads by columns, more slowly). --no-mmap: copies always.")(f)
    f = click.option("--activation-sparsity", "activation", default="0", show_default=True, metavar="S|auto",
                     callback=_activation_level,
                     help="Drop the share S of each projection's input by magnitude (q/k/v, output, gate/up, down; "
                          "thresholds recorded by convert --activation-thresholds, e.g. 0.2): each runs by columns "
                          "and reads only the rows of the inputs it keeps. auto: the level per projection the "
                          "converter chose within its --max-ppl-increase. 0: off.")(f)
    f = click.option("--vram-budget", type=float, default=None, metavar="GIB",
                     help="GiB of VRAM the GPU part may use (default: free VRAM minus 0.5 GiB); the plan is "
                          "printed at load.")(f)
    return f


def _activation_level(ctx, param, value):
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a share of inputs such as 0.2, or auto") from None


def runtime_config(kw):
    """RuntimeOptions from the verb's options (runtime_options or placement_options); -v of the
    pinfer command makes the runtime say what it chose."""
    from pinfer.runtime.model import RuntimeOptions

    ctx = click.get_current_context(silent=True)
    return RuntimeOptions(n_ctx=kw.get("n_ctx", 0), threads=kw.get("threads", 0),
                          sparsity="dense" if kw.get("dense") else kw.get("sparsity", ""),
                          kernels=kw.get("ffn_kernel") or "auto", device=kw.get("device") or "auto",
                          vram_budget=kw.get("vram_budget"), dense_device=kw.get("dense_device") or "cpu",
                          dense_kernel=kw.get("dense_kernel") or "on", kv_type=kw.get("kv_type") or "f16",
                          mmap=kw.get("mmap"), activation=kw.get("activation") or 0.0,
                          verbose=bool(ctx and verbose(ctx)))


def sampling_options(f):
    opts = [
        click.option("-s", "--seed", type=int, default=-1, show_default=True, help="RNG seed (-1: random)."),
        click.option("--temp", type=float, default=0.8, show_default=True, help="Temperature (0: greedy)."),
        click.option("--top-k", type=int, default=40, show_default=True, help="Top-k (0: off)."),
        click.option("--top-p", type=float, default=0.95, show_default=True, help="Top-p (1: off)."),
        click.option("--min-p", type=float, default=0.05, show_default=True, help="Min-p (0: off)."),
        click.option("--repeat-penalty", type=float, default=1.0, show_default=True,
                     help="Repeat penalty (1: off)."),
        click.option("--repeat-last-n", type=int, default=64, show_default=True,
                     help="Tokens the repeat penalty looks back over."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def sampler_config(kw):
    from pinfer.runtime.sample import SamplerConfig

    return SamplerConfig(temp=kw["temp"], top_k=kw["top_k"], top_p=kw["top_p"], min_p=kw["min_p"],
                         repeat_penalty=kw["repeat_penalty"], repeat_last_n=kw["repeat_last_n"],
                         seed=kw["seed"])


def open_session(path, kw):
    """A loaded Session, its notes printed."""
    from pinfer.runtime.generate import Session

    options = runtime_config(kw)
    session = Session(path, options)
    say_notes(session.model, options.verbose)
    return session


def say_notes(model, verbose):
    """Print what loading chose (model.notes: device fallbacks, the GPU plan, autotune's
    measurements), the quiet ones only with -v."""
    for note in model.notes:
        if verbose or not note.quiet:
            err(note.describe())


def err(msg):
    click.echo(msg, err=True)
    sys.stderr.flush()
