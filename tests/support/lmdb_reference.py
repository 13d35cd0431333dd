"""Read an LMDB database with DeePMD-kit 3.2.0's ``LmdbDataReader`` and pickle what it yields.

Run by the tests with DeePMD-kit's interpreter (:mod:`deepmd_env`)::

    python lmdb_reference.py DB TYPE_MAP_JSON REQUIREMENTS_JSON OUT.pkl

Requirements are ``DataRequirementItem`` keyword dicts. The pickle holds plain numpy and Python
values: ``frames`` (``reader[i]`` for every i), ``nloc_groups`` and ``nframes``.
"""

from __future__ import annotations

import json
import pickle
import sys

import numpy as np


def main(db: str, type_map: str, requirements: str, out: str) -> None:
    from deepmd.dpmodel.utils.lmdb_data import LmdbDataReader
    from deepmd.utils.data import DataRequirementItem

    reader = LmdbDataReader(db, json.loads(type_map), batch_size="auto")
    reader.add_data_requirement([DataRequirementItem(**r) for r in json.loads(requirements)])
    frames = [reader[i] for i in range(len(reader))]
    groups = {int(k): np.asarray(v).tolist() for k, v in reader.nloc_groups.items()}
    with open(out, "wb") as fh:
        pickle.dump({"frames": frames, "nloc_groups": groups, "nframes": len(reader)}, fh)
    reader.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
