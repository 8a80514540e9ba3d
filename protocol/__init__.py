"""The dspark wire contract (docs/contract.md): pure Python, numpy and msgspec.

No sockets, threads, clocks or torch: the worker and the client both speak the contract through
this package, and nothing else of theirs encodes or decodes a frame.
"""

from . import constants, errors, wire

__all__ = ["constants", "errors", "wire"]
