"""The catalog of a job's systems: discover the entries of ``systems``, describe each system from
its headers, and save the catalog as an index so that later starts reuse it. Rank 0's side of
the build; imports the leaves and ``mdloader.data``, never ``torch.distributed``."""
