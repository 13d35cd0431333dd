"""Reading DeePMD data: formats (npy, HDF5), the key schema, system descriptions, frames and
datasets. Never imports torch.distributed: what travels between ranks is decided elsewhere."""
