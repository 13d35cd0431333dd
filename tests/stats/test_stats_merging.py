"""One fold for every kind of partial statistics: in the order given, by the type's own merge,
and at least one part."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from mdloader.errors import ConfigError
from mdloader.stats.env_mat import EnvMatSums
from mdloader.stats.merging import merge_all
from mdloader.stats.neighbours import Finding, NeighbourStats


@dataclass(frozen=True)
class Word:
    text: str

    def merge(self, other: Word) -> Word:
        return Word(self.text + other.text)


def test_parts_are_merged_first_to_last_from_any_iterable() -> None:
    assert merge_all([Word("a"), Word("b"), Word("c")]) == Word("abc")
    assert merge_all(Word(c) for c in "xyz") == Word("xyz")
    one = Word("alone")
    assert merge_all([one]) is one


def test_no_part_is_refused_the_empty_value_is_the_callers() -> None:
    with pytest.raises(ConfigError, match="no partial statistics to merge: give at least one "
                                          r"part \(the empty value of its type"):
        merge_all([])
    with pytest.raises(ConfigError, match="no partial statistics to merge"):
        merge_all(iter(()))
    empty = NeighbourStats.empty(6.0, 2, False)
    assert merge_all([empty]) == empty


def test_neighbour_findings_are_kept_in_the_order_of_the_parts() -> None:
    found = [Finding(f"s{i}", None, i, "isolated") for i in range(5)]
    parts = [NeighbourStats(6.0, False, (i, 5 - i), 10.0 - i, (found[i],) if i % 2 else ())
             for i in range(5)]
    merged = merge_all([NeighbourStats.empty(6.0, 2, False), *parts, parts[1]])
    assert merged == NeighbourStats(6.0, False, (4, 5), 6.0)
    assert merged.findings == (found[1], found[3], found[1])


def test_sums_are_added_in_the_order_given() -> None:
    rng = np.random.default_rng(0)
    parts = [EnvMatSums(np.ones((2, 2)), rng.normal(size=(2, 2)) * 10.0 ** rng.integers(-8, 8),
                        rng.random((2, 2))) for _ in range(50)]
    expected = parts[0].total
    for part in parts[1:]:
        expected = expected + part.total
    np.testing.assert_array_equal(merge_all(parts).total, expected)  # bit for bit
    assert merge_all(parts).number.tolist() == [[50.0, 50.0], [50.0, 50.0]]
