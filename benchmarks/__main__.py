"""`python -m benchmarks run decode|prompt|memory|quality [...]`, `python -m benchmarks render`:
see benchmarks/harness/cli.py, or `python -m benchmarks --help`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))    # the one idiom (benchmarks/__init__.py)

from harness.cli import main  # noqa: E402

sys.exit(main())
