"""The mdloader command line: one module per sub-command (check, bench, train, convert, pack,
index, dp), and :mod:`mdloader.cli.main`, which dispatches to them."""
