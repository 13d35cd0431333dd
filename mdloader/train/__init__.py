"""The reference training job: a small energy/force potential trained with DDP on mdloader."""
