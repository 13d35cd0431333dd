"""The LMDB format: DeePMD-kit 3.2's databases of msgpack frames, read and written."""
