"""Node-local staging: how fast the stager copies against ``cp -r``, and what a staged job reads
from the shared tree over several passes (:mod:`benchmarks.staging.run`)."""
