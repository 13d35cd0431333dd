"""The scale benchmark's table: growth exponents and cells over budget."""

from __future__ import annotations

import pytest

from benchmarks.scale.run import slope, table


def test_slope_is_the_growth_exponent_in_world_size() -> None:
    assert slope([(w, 3e-3 * w) for w in (8, 64, 512)]) == pytest.approx(1.0)
    assert slope([(w, 0.01) for w in (8, 64, 512)]) == pytest.approx(0.0, abs=1e-9)
    assert slope([(8, 0.01)]) is None


def test_table_marks_cells_over_budget_and_fits_the_measured_ones() -> None:
    rows = [{"row": "key", "nsys": 1000, "world": w, "mode": "balanced", "seconds": 1e-3 * w,
             "peak_MiB": 1.0, "value": None} for w in (8, 64)]
    rows.append({"row": "key", "nsys": 1000, "world": 512, "mode": "balanced",
                 "over_budget": True})
    lines = table(rows)
    assert lines[0].startswith("| mode | N | row | W = 8 | W = 64 | W = 512 |")
    assert lines[2].endswith("| over budget | 1.00 |")
