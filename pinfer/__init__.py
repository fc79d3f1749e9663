"""pinfer: convert a model once into a `.pinf` file, then run it with a tiny runtime.

The code lives in the top-level folders formats/, converter/, runtime/ and cli/, installed as
pinfer.formats, pinfer.converter, pinfer.runtime and pinfer.cli."""
