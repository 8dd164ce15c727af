"""kvblend: CacheBlend-style KV reuse for RAG serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvblend")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
