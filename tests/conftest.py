"""Shared fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The real DeePMD systems beside the checkout; tests using it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _restore_mdloader_logger():
    """``mdloader.cli.main.main`` configures the ``mdloader`` logger for a process (handlers on
    stderr, no propagation); undo it after each test so caplog and later tests see the default."""
    import logging

    logger = logging.getLogger("mdloader")
    before = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in list(logger.handlers):
        if handler not in before[0]:
            logger.removeHandler(handler)
            handler.close()
    logger.setLevel(before[1])
    logger.propagate = before[2]
