"""The benchmarks page is generated: ``docs/benchmarks.md`` is what ``benchmarks/report.py``
makes of ``benchmarks/report_text.md`` and the recorded results, byte for byte."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import plots, report

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = REPO / "benchmarks" / "results"


def test_benchmarks_page_is_regenerated_from_the_results() -> None:
    results = sorted(str(p) for p in RESULTS.glob("*.jsonl"))
    text = report.page(results, str(DOCS / "img"), redraw=False)
    assert text == (DOCS / "benchmarks.md").read_text(encoding="utf-8"), (
        "docs/benchmarks.md is out of date: run "
        "python -m benchmarks.report benchmarks/results/*.jsonl --keep-plots")


@pytest.mark.parametrize("page", ["docs/benchmarks.md", "README.md"])
def test_benchmarks_page_names_no_tracker_numbers(page: str) -> None:
    """Only DeePMD-kit's own pull requests and issues may be cited by number."""
    text = (REPO / page).read_text(encoding="utf-8")
    for m in re.finditer(r"\bissues?\b[ -]?#?\d", text, re.IGNORECASE):
        before = text[max(0, m.start() - 20):m.start()]
        assert re.search(r"(DeePMD-kit|deepmd-kit) *$", before), (
            f"an issue number in {page}: {text[m.start() - 40:m.end()]!r}")
    for m in re.finditer(r"#\d+", text):
        before = text[max(0, m.start() - 20):m.start()]
        assert re.search(r"(DeePMD-kit|deepmd-kit)( PR| issue)? *$", before), (
            f"a tracker number not DeePMD-kit's in {page}: {text[m.start() - 40:m.end()]!r}")


def test_kept_plots_are_listed_in_page_order(tmp_path: Path) -> None:
    for name in reversed(plots.FILES[:2]):
        (tmp_path / name).write_bytes(b"png")
    assert plots.existing(str(tmp_path)) == [str(tmp_path / n) for n in plots.FILES[:2]]
