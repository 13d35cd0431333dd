"""List options (``--type-map``, ``--unmatched``) in any order with a command's arguments: one
helper (:mod:`mdloader.cli.arguments`) for every command, one rule, and a line saying how to
write the names when a value is in doubt. ``nargs="+"`` used to swallow ``pack --type-map O H
SRC DEST``'s SRC and DEST."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mdloader.cli.arguments import untangle
from mdloader.cli.main import build_parser, main
from mdloader.errors import ConfigError
from mdloader.testing import make_system


def _parse(argv: list[str]):
    return build_parser().parse_args(untangle(argv))


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    make_system(tmp_path / "data", "s0", natoms=3, nframes=4, type_map=None)
    make_system(tmp_path, "water", natoms=3, nframes=2, type_map=None)
    return tmp_path


PACK_ORDERS = [
    ["data/s0", "out.lmdb", "--type-map", "O", "H"],
    ["--type-map", "O", "H", "data/s0", "out.lmdb"],
    ["--type-map=O,H", "data/s0", "out.lmdb"],
    ["--type-map", "O,H", "data/s0", "out.lmdb"],
    ["--type-map", "O,H", "water", "out"],  # O,H is the whole list: plain names follow
    ["--type-map", "O", "--type-map", "H", "data/s0", "out.lmdb"],
    ["data/s0", "--type-map", "O", "H", "out.lmdb"],
    ["--type-map", "O", "H", "water", "out"],  # plain names: water exists, so it is a path
    ["--type-map", "O", "H", "--", "data/s0", "out.lmdb"],
    ["data/s0", "out.lmdb", "--type-map", "O", "H", "-v", "WARNING"],
]


@pytest.mark.parametrize("argv", PACK_ORDERS, ids=" ".join)
def test_pack_parses_in_every_order(here: Path, argv: list[str]) -> None:
    args = _parse(["pack", *argv])
    src = "water" if "water" in argv else "data/s0"
    assert (args.src, args.dest, args.type_map) == (
        [src], "out" if src == "water" else "out.lmdb", ["O", "H"])


def test_sources_on_both_sides_of_the_option_all_stay(here: Path) -> None:
    """Before, argparse gave ``s0`` to SRC and ``water`` to DEST, then refused ``out.lmdb``."""
    args = _parse(["pack", "data/s0", "water", "--type-map", "O", "H", "out.lmdb"])
    assert (args.src, args.dest, args.type_map) == (["data/s0", "water"], "out.lmdb", ["O", "H"])


@pytest.mark.parametrize("argv", [PACK_ORDERS[1], PACK_ORDERS[2]], ids=" ".join)
def test_pack_writes_the_database_in_every_order(
        here: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", *argv]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"{here / 'out.lmdb'}\t1 systems\t4 frames\ttype_map O H", line


@pytest.mark.parametrize("command, argv, expected", [
    ("convert", ["--type-map", "O", "H", "in.xyz", "out", "--from", "extxyz"],
     ("in.xyz", "out")),
    ("convert", ["in.xyz", "--type-map", "O,H", "out", "--from", "extxyz"], ("in.xyz", "out")),
    ("check", ["--type-map", "O", "H", "data/s0", "water"], ["data/s0", "water"]),
    ("check", ["data/s0", "--type-map", "O", "H"], ["data/s0"]),
])
def test_convert_and_check_take_the_same_rule(here: Path, command: str, argv: list[str],
                                              expected: object) -> None:
    args = _parse([command, *argv])
    got = (args.src, args.dest) if command == "convert" else args.input
    assert (got, args.type_map) == (expected, ["O", "H"])


def test_cache_unmatched_ends_at_a_value_that_is_no_file(here: Path) -> None:
    for name in ("a.json", "b.json"):
        (here / name).write_text("{}")
    args = _parse(["cache", "--unmatched", "a.json", "b.json", "prune", "--dry-run"])
    assert (args.action, args.unmatched, args.dry_run) == ("prune", ["a.json", "b.json"], True)
    args = _parse(["cache", "prune", "--unmatched", "a.json", "--unmatched", "b.json"])
    assert args.unmatched == ["a.json", "b.json"]
    args = _parse(["cache", "prune", "--unmatched", "gone.json"])  # cache says it is missing
    assert args.unmatched == ["gone.json"]


@pytest.mark.parametrize("argv, message", [
    (["pack", "data/s0", "out.lmdb", "--type-map", "O", "H"],
     r"^--type-map: H names an existing file or folder here, and may be a name too: write the "
     r"names as --type-map O,H, or as --type-map O with \./H for the path$"),
    (["pack", "--type-map", "data/s0", "out.lmdb"],
     r"^--type-map: no value before data/s0: write --type-map O,H \(then data/s0\)$"),
])
def test_a_value_in_doubt_is_refused_in_one_line(
        here: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder ``H`` beside ``--type-map O H``: the element or the path? Nothing is guessed."""
    (here / "H").mkdir()
    with pytest.raises(ConfigError, match=message):
        untangle(argv)
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mdloader: error: {message[1:-1]}".replace("\\", "")]
    assert _parse(["pack", "data/s0", "out.lmdb", "--type-map", "O,H"]).type_map == ["O", "H"]


def test_an_empty_name_is_a_usage_error(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", "data/s0", "out.lmdb", "--type-map", "O,,H"]) == 2
    assert "an empty name in 'O,,H': write the names as O,H" in capsys.readouterr().err


def test_nothing_after_double_dash_is_moved() -> None:
    argv = ["pack", "--type-map", "O", "H", "--", "--type-map", "X"]
    assert untangle(argv) == ["pack", "--type-map=O", "--type-map=H", "--", "--type-map", "X"]


def test_pack_refuses_a_destination_that_is_a_source(here: Path) -> None:
    """A mistyped order must not replace a source with ``--overwrite``."""
    before = sorted(p.name for p in (here / "data" / "s0").rglob("*"))
    assert main(["pack", "data/s0", "data/s0/", "--overwrite", "--type-map", "O,H"]) == 2
    assert sorted(p.name for p in (here / "data" / "s0").rglob("*")) == before
    assert np.load(here / "data" / "s0" / "set.000" / "coord.npy").shape[0] == 4
