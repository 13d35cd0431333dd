"""Makes a stager's copy wait (for the test of a stager killed while it stages): on a process
whose environment sets ``MDLOADER_TEST_SLOW_COPY`` to a file name, the first file the stager
copies (:func:`mdloader.catalog.staging.copy_file`) writes the process id into that file, then
waits until the process is killed."""

import builtins
import os
import sys
import time

_MARKER = os.environ.get("MDLOADER_TEST_SLOW_COPY")

if _MARKER and os.environ.get("LOCAL_RANK") is not None:
    _import = builtins.__import__

    def _slow_copy(*args, **kwargs):
        with open(_MARKER, "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(600)
        raise RuntimeError("a stager slowed for a test was not killed")

    def _import_then_slow(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        staging = sys.modules.get("mdloader.catalog.staging")
        if getattr(staging, "copy_file", _slow_copy) is not _slow_copy:  # defined, not yet slowed
            staging.copy_file = _slow_copy
            builtins.__import__ = _import
        return module

    builtins.__import__ = _import_then_slow
