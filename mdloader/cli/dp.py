"""``mdloader dp``: DeePMD-kit's own ``dp`` with mdloader as its data loader.

Everything after ``dp`` goes unparsed to DeePMD-kit (``--pt`` and ``--help`` included), so the
parser registered here only documents the command; :mod:`mdloader.cli.main` hands the rest of
the command line to :func:`run` as ``args.dp_args`` without parsing it
(:mod:`mdloader.integrations.deepmd`, imported only when it runs). Whether DeePMD-kit is
installed is asked first, without importing torch, so that its absence is told at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from mdloader.errors import ConfigError

#: ``main`` passes everything after the command name to :func:`run` unparsed, as ``args.dp_args``.
UNPARSED = "dp_args"

#: How to install DeePMD-kit next to mdloader, as the README says (the constraints keep torch).
INSTALL = ("pip install -c scripts/deepmd-constraints.txt -e \".[deepmd]\" in mdloader's "
           "repository (the constraints keep your torch; see docs/migrating.md)")

DESCRIPTION = ("Everything after `dp` is passed to DeePMD-kit, e.g. `mdloader dp --pt train "
               "input.json`; works under torchrun. Needs DeePMD-kit 3.2: " + INSTALL + ".")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader dp``'s parser (for ``mdloader --help`` and the reference page)."""
    p = sub.add_parser("dp", help="run DeePMD-kit's `dp` with mdloader as its data loader",
                       description=DESCRIPTION, add_help=False)
    p.add_argument("dp_args", nargs=argparse.REMAINDER)


def deepmd_installed() -> bool:
    """Whether ``import deepmd`` can find DeePMD-kit (nothing is imported)."""
    if "deepmd" in sys.modules:
        return sys.modules["deepmd"] is not None
    try:
        return importlib.util.find_spec("deepmd") is not None
    except (ImportError, ValueError):
        return False


def run(args: argparse.Namespace) -> int:
    """DeePMD-kit's ``dp`` with ``args.dp_args``; its exit code."""
    if not deepmd_installed():
        if {"-h", "--help"} & set(args.dp_args) or not args.dp_args:
            print(f"usage: mdloader dp [DP_ARGUMENTS ...]\n\n{DESCRIPTION}\n\n"
                  "DeePMD-kit is not installed here, so its own help cannot be shown.")
            return 0 if args.dp_args else 2
        raise ConfigError(f"DeePMD-kit is not installed; {INSTALL}", path="mdloader dp")
    from mdloader.integrations.deepmd import run_dp

    return run_dp(list(args.dp_args))
