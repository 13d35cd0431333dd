"""The catalog of a job's systems: discover the entries of ``systems``, describe each system from
its headers, and keep the descriptions in the system index so that later starts reuse them.

Rank 0's side of the build: imports the leaves and ``mdloader.data``, never
``torch.distributed``."""
