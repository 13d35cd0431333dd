"""Moving opaque objects between ranks: framed packets, the process group, channels with
timeouts, small collectives and BroadcastingDataLoader. The only package that imports
torch.distributed; it knows nothing of systems or samplers."""
