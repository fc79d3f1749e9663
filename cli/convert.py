"""`pinfer convert MODEL.gguf|HF_FOLDER`: one .pinf file from a GGUF model or a Hugging Face folder."""

from pathlib import Path

import click

from .common import fail_cleanly, verbose


@click.command("convert")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file (default: SOURCE with the suffix .pinf; a folder gets FOLDER.pinf beside it).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--sparsity", default="auto", show_default=True, metavar="none|auto|MODE[:VALUE]",
              help="FFN sparsity: auto measures every mode and picks per layer the cheapest within "
                   "--max-ppl-increase; MODE is dense, down:S (skip down rows under the S quantile), "
                   "predicted:R or relu:R (predictor at mass recall R); none skips calibration.")
@click.option("--max-ppl-increase", type=float, default=0.01, show_default=True,
              help="Held-out perplexity budget of auto, as a fraction (0.01 = +1%).")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Calibration text (.txt, or .jsonl with \"text\"/\"messages\"); default: pinfer's built-in set.")
@click.option("--calib-tokens", type=int, default=None,
              help="Calibration (training) tokens [default: adaptive, up to 24576: doubled from 4096 until the "
                   "first layer's predictor stops improving by 2%].")
@click.option("--heldout-tokens", type=int, default=8192, show_default=True,
              help="Held-out calibration tokens for thresholds and perplexity.")
@click.option("--quant", type=click.Choice(["auto", "int4", "fp16", "mixed"]), default="auto", show_default=True,
              help="FFN bundle formats: auto keeps source blocks exactly where possible; mixed keeps in fp16 "
                   "the hot neurons that fit --target-vram, int4 the rest.")
@click.option("--order", type=click.Choice(["auto", "hot-first", "source"]), default="auto", show_default=True,
              help="Neuron order: auto reorders hottest first where the mode selects neurons.")
@click.option("--target-vram", type=float, default=11.0, show_default=True,
              help="GiB of GPU memory for the default placement plan.")
@click.option("--calib-device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where calibration, predictor training and --activation-thresholds run: auto is the GPU "
                   "where PyTorch sees one (one layer's weights and activations in its memory at a time).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of sampling and predictor training.")
@click.option("--no-early-check", is_flag=True,
              help="With --sparsity auto, calibrate fully even where a quick sample shows no sparse point can "
                   "decode faster than dense on this machine (by default the dense file is written at once).")
@click.option("--activation-thresholds", is_flag=True,
              help="Record each layer's activation sparsity thresholds at 0.1 to 0.5 from a pass over the "
                   "calibration text (for --activation-sparsity S when the model runs); with --sparsity none "
                   "nothing else is calibrated.")
@click.option("--no-verify", is_flag=True, help="Skip reloading and checking the output.")
@click.option("--dry-run", is_flag=True, help="Print the plan (memory, disk, formats) and stop.")
@click.pass_context
def command(ctx, source, output, force, sparsity, max_ppl_increase, calib, calib_tokens, heldout_tokens,
            quant, order, target_vram, calib_device, seed, no_early_check, activation_thresholds, no_verify, dry_run):
    """Convert a GGUF model, or a Hugging Face folder (config.json, *.safetensors, tokenizer.json), into a .pinf file."""
    import signal

    from pinfer.converter.convert import ConvertOptions, convert
    from pinfer.converter.passes import PassOptions

    # SIGTERM unwinds like Ctrl-C, so the partial output is removed on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    passes = PassOptions(sparsity=sparsity, max_ppl_increase=max_ppl_increase, calib=calib,
                         calib_tokens=calib_tokens, heldout_tokens=heldout_tokens, order=order, seed=seed,
                         early_check=not no_early_check, calib_device=calib_device, activation=activation_thresholds)
    with fail_cleanly(verbose(ctx)):
        out = convert(ConvertOptions(source=source, output=output, force=force, passes=passes, quant=quant,
                                     target_vram_gib=target_vram, dry_run=dry_run, verify=not no_verify))
    if out is not None:
        click.echo(str(out))
