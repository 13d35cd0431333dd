"""Types of command-line arguments that argparse checks while it parses, and options that take
a list.

A bad count (``--numb-steps -5``) is then a usage error (exit 2) within a second, before a
command imports torch, instead of a ``ConfigError`` several seconds later.

A list option (``--type-map``) declared with ``nargs="+"`` swallows whatever follows it:
``pack --type-map O H SRC DEST`` left no SRC and DEST. Every list option is added by
:func:`add_list_option` and read by one rule (:data:`LIST_RULE`, :func:`untangle`, which
:mod:`mdloader.cli.main` applies to every command line): ``O,H``, ``--type-map=O,H`` and a
repeated option are never ambiguous; space-separated names end before the first path, and a
value in doubt is refused in one line that says how to write it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mdloader.errors import ConfigError


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"at_least_{minimum}"
    return parse


def positive_number(text: str) -> float:
    """An argparse ``type``: a number ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


# -- options that take a list ------------------------------------------------------------------

#: How a list of names is written, said once (``mdloader --help`` and the reference page).
LIST_RULE = ("--type-map takes its names as O,H (the whole list), --type-map=O,H, or repeated "
             "(--type-map O --type-map H), before, between or after the command's arguments. "
             "Written O H, the names end at the next option, at --, or before the first path: "
             "a value with / . * ? [ ~ or #, or one that names an existing file or folder. A "
             "value that names an existing file or folder and also looks like an element (a "
             "folder H beside --type-map O H) is refused in one line: write O,H.")


def is_path_like(value: str) -> bool:
    """Whether a value after ``--type-map``'s names is the command's own argument: it has a
    path character or names something that exists here."""
    return not _plain(value) or os.path.lexists(value)


def is_element_shaped(value: str) -> bool:
    """``O``, ``Cu``: a capital letter and at most one lower-case letter."""
    return 1 <= len(value) <= 2 and value.isalpha() and value[0].isupper() \
        and value[1:] == value[1:].lower()


def not_a_file(value: str) -> bool:
    """Whether a value after ``--unmatched``'s files is the command's own argument."""
    return not os.path.isfile(value)


@dataclass(frozen=True)
class ListOption:
    """How one list option reads: whether its values split at commas, and which value ends a
    space-separated run of them (the command's own argument begins there)."""

    split: bool
    ends: Callable[[str], bool]
    first_always: bool = False  # the first value is the option's whatever it is (a file
    #                             that does not exist is then named by the command)


#: Every list option of mdloader's commands.
LIST_OPTIONS: dict[str, ListOption] = {
    "--type-map": ListOption(split=True, ends=is_path_like),
    "--unmatched": ListOption(split=False, ends=not_a_file, first_always=True),
}


class ListValues(argparse.Action):
    """Appends every value of each use of the option (``O,H`` split at commas where the option
    splits), so that ``--type-map O,H``, ``--type-map=O,H`` and a repeated option agree."""

    def __init__(self, option_strings: list[str], dest: str, *, split: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="+", **kwargs)
        self.split = split

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        for value in values:
            parts = [p.strip() for p in value.split(",")] if self.split else [value]
            if not all(parts):
                raise argparse.ArgumentError(self, f"an empty name in {value!r}: write the "
                                             "names as O,H")
            items.extend(parts)
        setattr(namespace, self.dest, items)


def add_list_option(parser: argparse.ArgumentParser, flag: str, *, help: str,
                    metavar: str) -> None:
    """Add ``flag`` (one of :data:`LIST_OPTIONS`) to ``parser``; :func:`untangle`, called on
    every command line, lets its values and the command's arguments come in any order."""
    option = LIST_OPTIONS[flag]
    parser.add_argument(flag, action=ListValues, split=option.split, default=None,
                        metavar=metavar, help=f"{help}: O,H, repeated, or O H up to the first "
                        "path (`mdloader --help` gives the rule)" if option.split else
                        f"{help}; repeated, or space-separated up to the first value that "
                        "names no existing file")


def untangle(argv: Sequence[str]) -> list[str]:
    """``argv`` of a command (``argv[0]``) with each list option's space-separated values
    written as ``--flag=value`` and placed first, so that argparse neither swallows the
    command's arguments into the list (``pack --type-map O H SRC DEST``) nor loses some of them
    between two options. Nothing after ``--`` is touched.

    A run of values ends at the next option or ``--``, after a value with a comma where the
    option splits (``O,H`` is the whole list), or before the first value that its
    :class:`ListOption` ``ends`` (:data:`LIST_RULE`); ``--flag=v`` stays as it is.

    Raises
    ------
    ConfigError
        A name in doubt: a run of ``--type-map`` names ends at a value that names an existing
        file or folder and also looks like an element (``--type-map O H`` beside a folder
        ``H``): nothing is guessed, the line says how to write the names.
    """
    rest = list(argv[1:])
    moved: list[str] = []
    kept: list[str] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--":
            kept.extend(rest[i:])
            break
        option = LIST_OPTIONS.get(token)
        if option is None:
            kept.append(token)
            i += 1
            continue
        j = i + 1
        if option.first_always and j < len(rest) and not rest[j].startswith("-"):
            j += 1
        while j < len(rest) and not rest[j].startswith("-") and not option.ends(rest[j]):
            j += 1
            if option.split and "," in rest[j - 1]:  # O,H is the whole list
                break
        values = rest[i + 1:j]
        if option.split and j < len(rest) and is_element_shaped(rest[j]):
            names = ",".join(values + [rest[j]])
            raise ConfigError(f"{rest[j]} names an existing file or folder here, and may be a "
                              f"name too: write the names as {token} {names}, or as "
                              f"{token} {','.join(values) or '...'} with ./{rest[j]} for the "
                              "path", path=token)
        if not values and j < len(rest) and not rest[j].startswith("-"):
            raise ConfigError(f"no value before {rest[j]}: write {token} "
                              f"{'O,H' if option.split else 'a.json'} (then {rest[j]})",
                              path=token)
        if not values:  # nothing follows, or an option: argparse says what is missing
            kept.append(token)
        moved.extend(f"{token}={value}" for value in values)
        i = max(j, i + 1)
    return list(argv[:1]) + moved + kept


def _plain(value: str) -> bool:
    """A value without a path character: a name may be written so."""
    return not any(c in value for c in "/.*?[~#")
