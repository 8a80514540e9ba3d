"""The reference pair's corpus: the ``.py`` sources of Python's standard library, which every
machine that runs dspark has. Files whose relative path hashes to 0 mod 10 (first byte of its
SHA-256) are held out: the pair never trained on them, and acceptance is measured on them.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path


def stdlib_sources() -> Iterator[tuple[str, bytes, bool]]:
    """(relative path, bytes, held out) for each standard library source, in a fixed order;
    tests and third-party packages left out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if "site-packages" in rel or "/test" in rel or rel.startswith("test"):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        yield rel, data, hashlib.sha256(rel.encode()).digest()[0] % 10 == 0


def heldout_prompts(n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` bytes from held-out files (each from a third of the way in,
    past the imports), as token ids."""
    out: list[list[int]] = []
    for _, data, held in stdlib_sources():
        if held and len(data) >= 4 * length:
            start = len(data) // 3
            out.append(list(data[start:start + length]))
            if len(out) == n:
                return out
    raise ValueError(f"the standard library holds fewer than {n} held-out files of"
                     f" {4 * length} bytes or more")
