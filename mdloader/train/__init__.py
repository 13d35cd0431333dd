"""The reference training job: a small energy/force potential trained with DDP on mdloader, with
validation shared by the ranks and checkpoints that restart on any number of ranks."""
