"""Where reading, moving and sampling meet: the build (rank 0 catalogs, every rank receives one
broadcast), ``DpLoaderSet`` and its per-system loaders, the worker pool, and the feed that holds
a job's streams for both trainers."""
