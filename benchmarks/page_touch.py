"""How fast this machine faults in fresh memory, in 2 MB (transparent huge) pages and in 4 KB pages:
what a load that copies weights into new memory pays before it reads a byte of them.

    python benchmarks/page_touch.py [--gb 3] [--idle 8] [--rounds 2]

Each touch runs in a fresh process (one write per 4 KB page of an anonymous map, MADV_HUGEPAGE or
not), after --idle seconds of idling, the two kinds alternating. On a virtual machine that hands
freed memory back to its host, memory idle for a few seconds is faulted in from the host again,
and the two page sizes pay differently (docs/benchmarks.md, "Loading and memory").
"""

import argparse
import mmap
import subprocess
import sys
import time

CHILD = r'''
import mmap, sys, time
import numpy as np
n, huge = int(sys.argv[1]), sys.argv[2] == "huge"
mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if huge:
    mm.madvise(mmap.MADV_HUGEPAGE)
a = np.frombuffer(mm, np.uint8)
t = time.perf_counter()
a[::4096] = 1
print(n / (time.perf_counter() - t) / 1e9)
'''


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--idle", type=float, default=8.0, help="seconds idle before each touch")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        sys.exit("this system has no transparent huge pages (MADV_HUGEPAGE)")
    n = int(a.gb * 1e9) // 4096 * 4096
    runs = {"2 MB": [], "4 KB": []}
    for _ in range(a.rounds):
        for kind, arg in (("2 MB", "huge"), ("4 KB", "small")):
            time.sleep(a.idle)
            out = subprocess.run([sys.executable, "-c", CHILD, str(n), arg], capture_output=True, text=True, check=True)
            runs[kind].append(float(out.stdout))
    for kind, rs in runs.items():
        print(f"{kind} pages: {', '.join(f'{r:.2f}' for r in rs)} GB/s ({a.gb:g} GB touched after {a.idle:g} s idle)")


if __name__ == "__main__":
    sys.exit(main())
