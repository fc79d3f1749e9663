"""pinfer's benchmarks: `python -m benchmarks run SUITE` and `python -m benchmarks render`
(benchmarks/harness), and the single-purpose scripts beside them.

How the modules here find each other, the one way: everything in benchmarks/ imports its
neighbours by bare name (`import engines`, `from harness import WIKITEXT`). A script run as
`python benchmarks/NAME.py` has this folder first on sys.path by Python's own rule;
`python -m benchmarks` puts it there once, in benchmarks/__main__.py. No script adds a path of
its own. Nothing here is imported by pinfer."""
