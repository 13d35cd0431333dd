"""``mdloader dp``: DeePMD-kit's own ``dp`` with mdloader as its data loader.

Everything after ``dp`` goes unparsed to DeePMD-kit (``--pt`` and ``--help`` included), so the
parser registered here only documents the command; :mod:`mdloader.cli.main` hands the rest of
the command line to :func:`run` as ``args.dp_args`` without parsing it
(:mod:`mdloader.integrations.deepmd`, imported only when it runs).
"""

from __future__ import annotations

import argparse

#: ``main`` passes everything after the command name to :func:`run` unparsed, as ``args.dp_args``.
UNPARSED = "dp_args"


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``mdloader dp``'s parser (for ``mdloader --help`` and the reference page)."""
    p = sub.add_parser(
        "dp", help="run DeePMD-kit's `dp` with mdloader as its data loader",
        description="Everything after `dp` is passed to DeePMD-kit, e.g. "
        "`mdloader dp --pt train input.json`; works under torchrun. Needs DeePMD-kit "
        "(pip install 'mdloader[deepmd]').", add_help=False)
    p.add_argument("dp_args", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    """DeePMD-kit's ``dp`` with ``args.dp_args``; its exit code."""
    from mdloader.integrations.deepmd import run_dp

    return run_dp(list(args.dp_args))
