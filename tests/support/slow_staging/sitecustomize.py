"""Makes a stager's copy wait (for the test of a stager killed while it stages): on a process
whose environment sets ``MDLOADER_TEST_SLOW_COPY`` to a file name, the first copy of a file
writes the process id into that file, then waits until the process is killed."""

import os
import time

_MARKER = os.environ.get("MDLOADER_TEST_SLOW_COPY")

if _MARKER and os.environ.get("LOCAL_RANK") is not None:
    _copy = os.copy_file_range

    def _slow_copy(*args, **kwargs):
        with open(_MARKER, "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(600)
        return _copy(*args, **kwargs)

    os.copy_file_range = _slow_copy
