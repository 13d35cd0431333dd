"""Read systems with DeePMD-kit 3.2.0's own per-frame reader and pickle the frames.

Run by the tests with DeePMD-kit's interpreter (:mod:`deepmd_env`)::

    python npy_reference.py SYSTEMS_JSON TYPE_MAP_JSON REQUIREMENTS_JSON OUT.pkl

``deepmd.pt.utils.dataset.DeepmdDataSetForLoader`` (npy folders and ``file.h5#/group``
systems) with ``DataRequirementItem`` keyword dicts added; the pickle holds, per system, every
frame (``dataset[i]``) as plain numpy and Python values.
"""

from __future__ import annotations

import json
import pickle
import sys


def main(systems: str, type_map: str, requirements: str, out: str) -> None:
    from deepmd.pt.utils.dataset import DeepmdDataSetForLoader
    from deepmd.utils.data import DataRequirementItem

    found = []
    for system in json.loads(systems):
        data = DeepmdDataSetForLoader(system, json.loads(type_map))
        data.add_data_requirement([DataRequirementItem(**r) for r in json.loads(requirements)])
        found.append([data[i] for i in range(len(data))])
    with open(out, "wb") as fh:
        pickle.dump(found, fh)


if __name__ == "__main__":
    main(*sys.argv[1:5])
