"""Reading the data once per job rather than once per node: four staging designs simulated at
1 000 nodes in one process (:mod:`benchmarks.staging_scale.run`)."""
