"""Shared fixtures."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# System indexes written by the tests go to a folder of this run, never to the user's cache; set
# before any rank or subprocess starts, so that they inherit it, and removed when the run ends.
os.environ["MDLOADER_CACHE_DIR"] = tempfile.mkdtemp(prefix="mdloader-test-index-")
atexit.register(shutil.rmtree, os.environ["MDLOADER_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def real_data() -> Path:
    """Real DeePMD systems shipped with the repository: ``water/`` (the example's data) and
    ``deepmd-tests/`` (DeePMD-kit's small test fixtures; see ``tests/fixtures/NOTICE.md``)."""
    return REPO / "tests" / "fixtures"


@pytest.fixture
def water_data() -> Path:
    """DeePMD-kit's water example data (four 192-atom systems, ``data_1`` with two sets)."""
    return REPO / "examples" / "water" / "data"


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
