"""Reading DeePMD data: formats (npy, HDF5, LMDB), the key schema, system descriptions, frames and
datasets, and the LMDB writer. Never imports torch.distributed: what travels between ranks is
decided elsewhere."""
