"""Client tests: make ``tests.support`` importable (the repository root on sys.path) and the
helpers of this folder (``client_fakes``) importable by name."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for path in (_HERE, _ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
