"""`pinfer verify FILE`: check every byte of a .pinf file against its checksums."""

import sys
import time
from pathlib import Path

import click

from .common import fail_cleanly
from .common import verbose as is_verbose


@click.command("verify")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.pass_context
def command(ctx, path):
    """Check a .pinf file's header and every tensor's checksum; name what is damaged."""
    from pinfer.formats import PinfReader

    with fail_cleanly(is_verbose(ctx)):
        r = PinfReader(path)
        total = sum(e["nbytes"] for e in r.tensors.values()) or 1
        done, t0, last = 0, time.perf_counter(), 0.0

        def progress(n):
            nonlocal done, last
            done += n
            now = time.perf_counter()
            if sys.stderr.isatty() and (now - last > 0.1 or done == total):
                last = now
                bar = "#" * int(30 * done / total)
                click.echo(f"\\r[{bar:30s}] {done / 1e6:8.1f} / {total / 1e6:.1f} MB", err=True, nl=False)

        bad = r.verify(progress)
        if sys.stderr.isatty():
            click.echo(err=True)
    dt = time.perf_counter() - t0
    if bad:
        click.echo(f"{path}: damaged: {', '.join(bad)}; convert the model again or copy the file again", err=True)
        ctx.exit(1)
    click.echo(f"{path}: OK ({len(r.tensors)} tensors, {total / 1e6:.1f} MB checked in {dt:.1f} s, "
               f"{total / 1e9 / max(dt, 1e-9):.2f} GB/s)")
