"""The `.pinf` container: schema, reader and writer."""

from .reader import PinfReader
from .schema import PinfFormatError
from .writer import PinfWriter

__all__ = ["PinfReader", "PinfWriter", "PinfFormatError"]
