"""Training-data statistics DeePMD-kit computes before step 1, owned by mdloader.

Neighbour statistics (:mod:`~mdloader.stats.neighbours`: minimal pair distance and maximal
neighbour counts, hence ``sel`` and ``min_nbor_dist``), descriptor environment-matrix statistics
(:mod:`~mdloader.stats.env_mat`: ``davg``/``dstd``), the output (energy) bias
(:mod:`~mdloader.stats.output`), per-feature moments for the feature scales of ``mdloader
train``'s reference model (:mod:`~mdloader.stats.moments`), which systems a rank takes
(:mod:`~mdloader.stats.shards`), the key and payload of a per-system cache entry
(:mod:`~mdloader.stats.cache`) and the folder that keeps the entries between jobs
(:mod:`~mdloader.stats.store`). Every partial result is computed on a share of the systems and
merges exactly (:func:`~mdloader.stats.merging.merge_all` folds any number of them), so each
rank can take a disjoint share and a collective can combine them.

This package may import only the leaves (``mdloader.errors``, ``mdloader.settings``,
``mdloader.world``, ``mdloader.logs``, ``mdloader.persist``), ``mdloader.data``, numpy and vesin;
never ``torch.distributed`` (merging across ranks is the caller's job).
"""
