"""Where reading, moving and sampling meet: the build (rank 0 catalogs, every rank receives one
broadcast), the loader a data section describes, ``DpLoaderSet`` and its per-system loaders, and
``StatefulLoader``."""
