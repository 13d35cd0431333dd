"""Batch-size rules against DeePMD-kit's documented numbers (``test_dploaderset.py``, §2.4)."""
from __future__ import annotations

import logging

import pytest

from mdloader.errors import ConfigError
from mdloader.sampling.batching import batches_per_rank, parse_rule, resolve_batch_sizes

# DeePMD-kit's test_dploaderset.py on the 192-atom water system.
DEEPMD_192 = [
    ("auto:384", 2), ("auto:383", 2), ("auto:193", 2), ("auto:192", 1), ("auto:191", 1),
    ("auto", 1), ("max:384", 2), ("max:383", 1), ("max:191", 1), ("filter:192", 1),
    (1, 1), (3, 3), ([4], 4),
]


@pytest.mark.parametrize("rule,expected", DEEPMD_192)
def test_deepmd_examples_192_atoms(rule, expected):
    plan = resolve_batch_sizes(rule, [192])
    assert plan.batch_sizes.tolist() == [expected]
    assert plan.kept.tolist() == [0]


def test_deepmd_data_sys_auto_rules():
    # tf/test_deepmd_data_sys.py: natoms [3, 4, 6, 5]; auto:5 -> [2,2,1,1]; auto:3 -> all 1.
    assert resolve_batch_sizes("auto:5", [3, 4, 6, 5]).batch_sizes.tolist() == [2, 2, 1, 1]
    assert resolve_batch_sizes("auto:3", [3, 4, 6, 5]).batch_sizes.tolist() == [1, 1, 1, 1]
    assert resolve_batch_sizes("auto", [3, 4, 6, 5]).batch_sizes.tolist() == [11, 8, 6, 7]


def test_filter_removes_and_logs(caplog):
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        plan = resolve_batch_sizes("filter:100", [50, 192, 100, 300])
    assert plan.kept.tolist() == [0, 2]
    assert plan.batch_sizes.tolist() == [2, 1]
    assert "Remove 2 systems with more than 100 atoms" in caplog.text


def test_filter_nothing_removed_is_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        plan = resolve_batch_sizes("filter:192", [192, 6])
    assert plan.batch_sizes.tolist() == [1, 32]
    assert caplog.text == ""


def test_filter_191_on_192_atoms_raises_and_logs(caplog):
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        with pytest.raises(ValueError,
                           match="No system left after removing systems with more than 191 atoms"):
            resolve_batch_sizes("filter:191", [192])
    assert "Remove 1 systems with more than 191 atoms" in caplog.text


@pytest.mark.parametrize("rule", ["unknown", "mixed:4", "auto:", "max", "max:x", "auto:0",
                                  "filter:-3"])
def test_unsupported_rules(rule):
    with pytest.raises(ValueError, match=f"Unsupported batch size rule: {rule}"):
        resolve_batch_sizes(rule, [192])


def test_rule_error_names_the_key():
    with pytest.raises(ConfigError, match=r"^training.training_data.batch_size: Unsupported"):
        resolve_batch_sizes("unknown", [3], key="training.training_data.batch_size")


def test_list_length_checked():
    with pytest.raises(ConfigError, match=r"batch_size: batch size list has 3 entries but there "
                                          r"are 2 systems"):
        resolve_batch_sizes([1, 2, 3], [6, 6])


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "3"])
def test_non_positive_or_non_int_sizes(bad):
    value = [bad] if not isinstance(bad, str) else bad
    with pytest.raises(ConfigError):
        resolve_batch_sizes(value, [6])
    if not isinstance(bad, str):
        with pytest.raises(ConfigError, match="must be a positive integer"):
            resolve_batch_sizes(bad, [6])


def test_zero_systems():
    with pytest.raises(ConfigError, match="no systems"):
        resolve_batch_sizes(4, [])


def test_parse_rule():
    assert parse_rule("auto") == ("auto", 32)
    assert parse_rule(" max : 7 ") == ("max", 7)


def test_batches_per_rank_matches_deepmd_index():
    # nb = ceil(ceil(F/W)/B): water data_0 F=80, B=1: serial 80, W=2 -> 40, W=3 -> 27.
    assert batches_per_rank([80], [1], 1).tolist() == [80]
    assert batches_per_rank([80], [1], 2).tolist() == [40]
    assert batches_per_rank([80], [1], 3).tolist() == [27]
    assert batches_per_rank([80, 1, 7], [4, 4, 2], 2).tolist() == [10, 1, 2]
