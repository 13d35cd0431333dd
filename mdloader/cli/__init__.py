"""The mdloader command line: check, bench, convert, train, dp."""
