"""Loading a model's layers: several at a time, and what loading frees handed back to the system."""

import ctypes
from concurrent.futures import ThreadPoolExecutor


def trim_heap():
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    Loading frees ONNX Runtime's and NumPy's temporaries, which glibc keeps in its arenas: 1.9 GB
    of the 7B-shaped model's 12.7 GB after load, more with layers loaded on several threads."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def load_map(workers, reader):
    """map(fn, n) -> [fn(0), ..., fn(n - 1)], `workers` layers at a time, then the file's pages and
    the heap's free ones handed back (PinfReader.release, trim_heap), which keeps the peak during
    load down. Loading a layer is mostly ONNX Runtime packing its weights and copies of the
    kernels' weights, which run without the GIL: the 7B-shaped model loaded in 39 s on one thread.
    The first failure is raised, in layer order."""
    def run(fn, n):
        if workers <= 1:
            out = [fn(i) for i in range(n)]
        else:
            with ThreadPoolExecutor(workers) as pool:
                out = list(pool.map(fn, range(n)))
        reader.release()
        trim_heap()
        return out
    return run
