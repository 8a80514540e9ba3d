"""Fixtures of the drafter tests (helpers live in drafter_support)."""

from __future__ import annotations

import pytest
from drafter_support import make_drafter

from dspark_worker.drafter import Drafter


@pytest.fixture(scope="session")
def tiny() -> Drafter:
    return make_drafter()
