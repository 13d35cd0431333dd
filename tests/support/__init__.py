"""Helpers the tests share: real gloo ranks with a hard deadline, the DeePMD-kit reference
interpreter and its scripts, the ``input.json`` writer, the elastic ledger, the file-system
audit and the statistics data."""
