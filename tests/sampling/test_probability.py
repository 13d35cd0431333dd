"""Probability styles against DeePMD-kit's numbers (§2.5) and the checks it lacks (§4.8)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from mdloader.errors import ConfigError
from mdloader.sampling.probability import (
    check_sys_probs,
    parse_blocks,
    process_sys_probs,
    select_prob_source,
    system_probabilities,
)

# water data_0, data_1 (80 frames) and single (1 frame), batch size 1, serial: nb = [80, 80, 1].
NB = [80, 80, 1]


def test_prob_uniform():
    np.testing.assert_array_equal(system_probabilities(NB, "prob_uniform"), [1 / 3] * 3)


def test_prob_sys_size():
    np.testing.assert_allclose(system_probabilities(NB, "prob_sys_size"),
                               [80 / 161, 80 / 161, 1 / 161], rtol=0, atol=1e-15)


def test_blocks_deepmd_test_sampler():
    # pt/test_sampler.py: "prob_sys_size;0:1:0.2;1:3:0.8"
    np.testing.assert_allclose(system_probabilities(NB, "prob_sys_size;0:1:0.2;1:3:0.8"),
                               [0.2, 0.8 * 80 / 81, 0.8 / 81], rtol=0, atol=1e-15)


def test_blocks_deepmd_data_sys_whitespace_and_ratios():
    # tf/test_deepmd_data_sys.py::test_prob_sys_size_1 / _2 (whitespace tolerated).
    nb = [5, 11, 9, 7]
    p = system_probabilities(nb, "prob_sys_size; 0:2:2; 2:4:8")
    assert p[:2].sum() == pytest.approx(0.2) and p[2:].sum() == pytest.approx(0.8)
    assert p[1] / p[0] == pytest.approx(11 / 5) and p[3] / p[2] == pytest.approx(7 / 9)
    p = system_probabilities(nb, "prob_sys_size; 1:2:0.4; 2:4:1.6")
    assert p[0] == 0.0 and p[1] == pytest.approx(0.2) and p.sum() == pytest.approx(1.0)


def test_block_end_past_nsys_is_clipped_like_deepmd():
    np.testing.assert_allclose(system_probabilities(NB, "prob_sys_size;0:1000:1"),
                               system_probabilities(NB, "prob_sys_size"))


def test_sys_probs_fixed_and_auto():
    np.testing.assert_array_equal(system_probabilities(NB, [0.1, 0.4, 0.5], sys_prob=True),
                                  [0.1, 0.4, 0.5])
    np.testing.assert_allclose(system_probabilities(NB, [0.1, -1, -1], sys_prob=True),
                               [0.1, 0.9 * 80 / 81, 0.9 / 81], rtol=0, atol=1e-15)


def test_sys_probs_floating_point_tolerance_1917():
    probs = [0.010] * 9 + [0.150, 0.100, 0.100, 0.050, 0.050, 0.020, 0.015, 0.015, 0.050,
                           0.020, 0.015, 0.040, 0.055, 0.025, 0.025, 0.015, 0.025, 0.055,
                           0.040, 0.040, 0.005]
    p = system_probabilities([3] * 30, probs, sys_prob=True)
    assert p.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("probs,match", [
    ([0.1, 0.4, 0.5], r"sys_probs: sys_probs has 3 entries but there are 1 systems"),
    ([0.2, 0.3, 0.4, 0.1, 0.0], "5 entries but there are 3"),
])
def test_sys_probs_length_checked(probs, match):
    nb = [80] if len(probs) == 3 else NB
    with pytest.raises(ConfigError, match=match):
        system_probabilities(nb, probs, sys_prob=True)


@pytest.mark.parametrize("probs,match", [
    ([0.2, 0.3, 0.4], r"sys_probs sum to 0.9, not 1"),
    ([1.0, -1, -1], r"already sum to 1, so the 2 negative"),
    ([0.6, 0.6, -1], r"non-negative sys_probs entries sum to 1.2 > 1"),
    ([0.5, float("nan"), 0.5], "finite numbers"),
    ([0.5, True, 0.5], "finite numbers"),
    ("0.5 0.5", "must be a list of numbers"),
])
def test_sys_probs_bad_values(probs, match):
    with pytest.raises(ConfigError, match=match):
        system_probabilities(NB, probs, sys_prob=True)


@pytest.mark.parametrize("style,match", [
    ("prob_sys_sze", r"auto_prob: unknown probability style 'prob_sys_sze'"),
    ("prob_unifrom", "unknown probability style"),
    ("prob_sys_size;", "has no 'start:end:weight' block"),
    ("prob_sys_size;0:1", r"malformed block '0:1'"),
    ("prob_sys_size;a:1:1", "malformed block"),
    ("prob_sys_size;0:2:1;1:3:1", r"blocks 0:2 and 1:3 .* overlap"),
    ("prob_sys_size;1:1:1", r"block 1:1:1 .* selects no system"),
    ("prob_sys_size;3:9:1", r"block 3:9:1 .* selects no system \(systems are 0..2\)"),
    ("prob_sys_size;-1:2:1", "selects no system"),
    ("prob_sys_size;0:1:-0.5", r"weight must be a finite number >= 0, got -0.5"),
    ("prob_sys_size;0:1:0;1:3:0", "block weights .* sum to 0"),
])
def test_bad_styles(style, match):
    with pytest.raises(ConfigError, match=match):
        system_probabilities(NB, style)


def test_zero_systems():
    with pytest.raises(ConfigError, match="no systems"):
        system_probabilities([], "prob_uniform")
    with pytest.raises(ConfigError, match="no systems"):
        system_probabilities([], [], sys_prob=True)


def test_zero_weight_block_allowed():
    p = system_probabilities(NB, "prob_sys_size;0:1:0;1:3:1")
    assert p[0] == 0.0 and p.sum() == pytest.approx(1.0)


def test_blocks_remapped_after_filter(caplog):
    # original systems 0..4; filter dropped 1 and 3; blocks written against the original list.
    kept = np.array([0, 2, 4])
    nb = [10, 20, 30]
    p = system_probabilities(nb, "prob_sys_size;0:2:0.5;2:5:0.5", kept=kept, nsys_original=5)
    np.testing.assert_allclose(p, [0.5, 0.5 * 20 / 50, 0.5 * 30 / 50])
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        p = system_probabilities(nb, "prob_sys_size;1:2:0.3;2:5:0.7", kept=kept, nsys_original=5)
    np.testing.assert_allclose(p, [0.0, 0.4, 0.6])
    assert "block 1:2:0.3 lost all its systems" in caplog.text


def test_sys_probs_remapped_after_filter(caplog):
    kept = np.array([0, 2, 4])
    nb = [10, 20, 30]
    p = system_probabilities(nb, [0.2, 0.1, -1, 0.3, -1], sys_prob=True, kept=kept,
                             nsys_original=5)
    # fixed 0.2 stays; the two auto systems share 0.8 by nb (20:30).
    np.testing.assert_allclose(p, [0.2, 0.8 * 20 / 50, 0.8 * 30 / 50])
    with caplog.at_level(logging.WARNING, logger="mdloader"):
        p = system_probabilities(nb, [0.2, 0.2, 0.2, 0.2, 0.2], sys_prob=True, kept=kept,
                                 nsys_original=5)
    np.testing.assert_allclose(p, [1 / 3] * 3)
    assert "removed by the batch-size filter" in caplog.text
    with pytest.raises(ConfigError, match="3 entries but there are 5 systems"):
        system_probabilities(nb, [0.2, 0.3, 0.5], sys_prob=True, kept=kept, nsys_original=5)
    with pytest.raises(ConfigError, match="probability 0 to every system left"):
        system_probabilities(nb, [0.0, 0.5, 0.0, 0.5, 0.0], sys_prob=True, kept=kept,
                             nsys_original=5)


def test_parse_blocks_and_check_helpers():
    assert [tuple(b) for b in parse_blocks("prob_sys_size;0:2:1", 3)] == [(0, 2, 1.0)]
    np.testing.assert_array_equal(check_sys_probs([0.5, -1], 2), [0.5, -1])
    np.testing.assert_allclose(process_sys_probs([0.5, -1, -1], [1, 1, 3]), [0.5, 0.125, 0.375])


def test_select_prob_source_precedence():
    assert select_prob_source({"sys_probs": [1.0], "auto_prob": "prob_uniform"}) == \
        ([1.0], True, "sys_probs")
    assert select_prob_source({"sys_probs": None, "auto_prob": "prob_uniform"}) == \
        ("prob_uniform", False, "auto_prob")
    assert select_prob_source({}) == ("prob_sys_size", False, "auto_prob")
