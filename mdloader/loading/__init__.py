"""Where reading, moving and sampling meet: the build (rank 0 catalogs, every rank receives one
broadcast), ``DpLoaderSet`` and its per-system loaders, and ``StatefulLoader``."""
