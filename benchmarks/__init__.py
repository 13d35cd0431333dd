"""Benchmarks of mdloader against DeePMD-kit: one launcher, one data generator, one rank worker.

Shared pieces live here (:mod:`benchmarks.launch`, :mod:`benchmarks.data`,
:mod:`benchmarks.worker`, the probes, the aggregation and the report); each question family has
its folder (``startup``, ``first_step``, ``statistics``, ``lmdb``, ``main_cost``, ``fs_traffic``,
``sampling``, ``throughput``, ``training``, ``gpu``) whose harnesses run as
``python -m benchmarks.<family>.<harness>`` (``gpu`` through ``benchmarks/gpu/run.sh``).
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
