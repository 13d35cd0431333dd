"""Progress reports (:func:`mdloader.logs.progress`): a bar on a terminal after the delay, plain
lines at a modest rate in a log, nothing on the other ranks."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pytest
from support.terminal import drawn_bar, stderr

from mdloader import logs
from mdloader.world import World


def _work(total: int, seconds: float, desc: str = "work") -> None:
    with logs.progress(total, desc) as bar:
        for _ in range(total):
            time.sleep(seconds / total)
            bar.update()


def test_a_terminal_gets_a_bar_only_for_work_longer_than_the_delay(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 0.1)
    caplog.set_level(logging.INFO, logger="mdloader")
    err = stderr(monkeypatch, tty=True)
    _work(5, 0.0)
    assert err.getvalue() == ""  # short work: nothing drawn
    _work(5, 0.4, "long work")
    assert drawn_bar(err.getvalue()) and "mdloader: long work" in err.getvalue()
    assert "5/5" in err.getvalue()
    assert not [r for r in caplog.records if r.name == "mdloader.progress"]  # no log lines


def test_a_log_gets_plain_lines_at_a_modest_rate(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 0.0)
    monkeypatch.setattr(logs, "PROGRESS_LOG_INTERVAL", 0.3)
    caplog.set_level(logging.INFO, logger="mdloader")
    err = stderr(monkeypatch, tty=False)
    _work(20, 1.0, "describing systems")
    lines = [r.getMessage() for r in caplog.records if r.name == "mdloader.progress"]
    assert 2 <= len(lines) <= 5, lines  # a line per interval (and the last), not per update
    assert lines[-1].startswith("describing systems: 20/20 sys (100%), ")
    assert all(re.match(r"describing systems: \d+/20 sys \(\d+%\), \S+ elapsed, \S+ left$",
                        line) for line in lines), lines
    assert err.getvalue() == ""  # no bar, no carriage returns
    caplog.clear()
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 5.0)
    _work(20, 0.3)  # shorter than the delay: not a line
    assert not [r for r in caplog.records if r.name == "mdloader.progress"]


@pytest.mark.parametrize("tty", [True, False])
def test_other_ranks_show_nothing(monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture, tty: bool) -> None:
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 0.0)
    monkeypatch.setattr(logs, "PROGRESS_LOG_INTERVAL", 0.0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    caplog.set_level(logging.INFO, logger="mdloader")
    err = stderr(monkeypatch, tty=tty)
    _work(4, 0.1)
    with logs.progress(4, "work", main=False) as bar:  # an explicit rank, as statistics give
        bar.update(4)
    with logs.progress(4, "work", enabled=False, main=True) as bar:
        bar.update(4)
    assert err.getvalue() == "" and not caplog.records
    monkeypatch.setenv("RANK", "0")
    _work(4, 0.1)
    assert err.getvalue() or caplog.records  # the same work on rank 0 is shown


def test_log_lines_go_above_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "PROGRESS_DELAY", 0.0)
    err = stderr(monkeypatch, tty=True)
    logs.setup_logging("INFO", world=World())
    with logs.progress(2, "work") as bar:
        bar.update()
        logging.getLogger("mdloader.catalog").info("a line while the bar is drawn")
        bar.update()
    text = err.getvalue()
    assert drawn_bar(text)
    pieces = [p for p in re.split(r"[\r\n]", text) if "a line while" in p]
    assert len(pieces) == 1  # its own line, with its timestamp, not onto the bar
    assert re.match(r"\d{4}-\d\d-\d\d ", pieces[0]) and "mdloader: work" not in pieces[0]


PACKAGE = Path(__file__).resolve().parents[1] / "mdloader"


@pytest.mark.parametrize("tty", [True, False])
def test_no_bar_starts_a_thread(monkeypatch: pytest.MonkeyPatch, tty: bool) -> None:
    """tqdm's monitor thread, started by any bar, even a disabled one, deadlocked a DataLoader
    worker forked while it started (Python 3.10: ``mdloader train``'s rank 1 hung at step 1)."""
    stderr(monkeypatch, tty=tty)
    before = threading.active_count()
    with logs.progress(3, "work") as bar, logs.progress(3, "elsewhere", main=False):
        bar.update()
        quiet = logs.bar(total=3, disable=True)
        assert threading.active_count() == before
    quiet.close()


def test_every_bar_is_made_in_logs() -> None:
    """A ``tqdm`` made elsewhere would start the monitor thread again."""
    imports = [str(path.relative_to(PACKAGE.parent)) for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "logs.py"
               and re.search(r"^\s*from tqdm import tqdm\b|^\s*import tqdm\b",
                             path.read_text(encoding="utf-8"), re.M)]
    assert imports == []
