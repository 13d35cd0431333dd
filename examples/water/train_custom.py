"""Use mdloader in your own training loop: a compact DDP job with exact resume and validation.

Run it from the repository root (CPU, 2 ranks, gloo)::

    torchrun --standalone --nproc_per_node=2 examples/water/train_custom.py --steps 20
    torchrun --standalone --nproc_per_node=2 examples/water/train_custom.py --steps 40 \
        --resume runs/custom/checkpoint.pt
    python examples/water/train_custom.py --steps 60 --resume runs/custom/checkpoint.pt

It also runs as a plain ``python examples/water/train_custom.py`` (one process, no process group).
The parts that concern mdloader are numbered; the model is a stand-in for yours.

1. Start the process group *before* the loader: ``DpLoaderSet`` uses it so that only rank 0 reads
   the data tree and the other ranks receive a compact description of every system.
2. ``DpLoaderSet`` + data requirements, with DeePMD-kit's names and arguments.
3. ``get_sampler_from_params``: draws a system by probability, then the next batch of that
   system's frames on this rank (reshuffled on every pass, seeded from ``--seed``).
4. The outer ``DataLoader`` exactly as DeePMD-kit's trainer builds it; workers only read.
5. A checkpoint holding the model, the optimizer and *every rank's* sampler state merged (a few
   integers); ``--resume`` continues each rank's batch stream where it stopped, or, on another
   number of ranks, resumes elastically (docs/sampling.md#elastic-resume).
6. A full validation pass: every validation frame once, shared by the ranks without padding, and
   the sums reduced across ranks, so the RMSE is the one a single rank would compute.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from mdloader import (
    DataRequirementItem,
    DpLoaderSet,
    gather_to_main,
    get_sampler_from_params,
    get_validation_sampler,
    merge_rank_states,
    reduce_sums,
    set_torch_threads,
)

HERE = Path(__file__).resolve().parent
SYSTEMS = [str(HERE / "data" / f"data_{i}") for i in range(3)]
VALIDATION = [str(HERE / "data" / "data_3")]
LABELS = [DataRequirementItem("energy", 1, atomic=False, must=True, high_prec=True),
          DataRequirementItem("force", 3, atomic=True, must=True)]


def identity(batch: dict) -> dict:
    """The outer DataLoader's collate_fn: batches are already collated by DpLoaderSet."""
    return batch


class PairPotential(torch.nn.Module):
    """Stand-in for your model: E = sum_i bias[t_i] + sum_{i != j} w[t_i, t_j] . phi(r_ij)."""

    def __init__(self, ntypes: int, rcut: float = 4.0, nbasis: int = 8) -> None:
        super().__init__()
        self.rcut = rcut
        self.register_buffer("centers", torch.linspace(0.8, rcut, nbasis, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.zeros(ntypes, dtype=torch.float64))
        self.w = torch.nn.Parameter(torch.zeros(ntypes, ntypes, nbasis, dtype=torch.float64))

    def forward(self, coord: torch.Tensor, atype: torch.Tensor, box: torch.Tensor | None):
        coord = coord.double().requires_grad_(True)            # [B, N, 3]
        diff = coord[:, None, :, :] - coord[:, :, None, :]     # [B, N, N, 3]
        if box is not None:                                    # minimum image
            cell = box.double().reshape(-1, 3, 3)
            frac = diff @ torch.linalg.inv(cell)[:, None]
            diff = (frac - torch.round(frac)) @ cell[:, None]
        eye = torch.eye(coord.shape[1], dtype=torch.bool, device=coord.device)
        r = torch.sqrt((diff * diff).sum(-1) + eye)            # self pairs: r = 1, masked out
        cutoff = torch.where((r < self.rcut) & ~eye, 0.5 * torch.cos(torch.pi * r / self.rcut)
                             + 0.5, torch.zeros_like(r))
        phi = torch.exp(-4.0 * (r[..., None] - self.centers) ** 2) * cutoff[..., None]
        t = atype.long()
        pair = (phi * self.w[t[:, :, None], t[:, None, :]]).sum((-1, -2, -3))
        energy = (self.bias[t].sum(-1) + pair)[:, None]        # [B, 1]
        (grad,) = torch.autograd.grad(energy.sum(), coord, create_graph=self.training)
        return energy, -grad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--output", default="runs/custom")
    p.add_argument("--resume", default=None, help="checkpoint to continue from")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=int(os.environ.get("NUM_WORKERS", 2)))
    p.add_argument("--disp-freq", type=int, default=10)
    args = p.parse_args()

    # 1. Process group first: gloo on CPU, NCCL on GPU (torchrun sets WORLD_SIZE, RANK, ...).
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(name)s: %(message)s")  # mdloader logs its build on rank 0

    # torch's share of this node's cores: its ranks and their DataLoader workers share them.
    set_torch_threads(args.num_workers)

    # 2. The loader set: rank 0 discovers and describes the systems, every rank receives them.
    ls = DpLoaderSet(SYSTEMS, batch_size="auto", type_map=["O", "H"], seed=args.seed)
    ls.add_data_requirement(LABELS)
    # 3. The sampler: one key (system, frame ids, step) per batch; state = a few integers.
    sampler = get_sampler_from_params(ls, {"auto_prob": "prob_sys_size"},
                                      num_workers=args.num_workers)
    ls.print_summary("training", sampler.weights.tolist())
    # 4. The outer DataLoader, as in DeePMD-kit's trainer: workers read the keys they are given.
    loader = DataLoader(ls, sampler=sampler, batch_size=None, num_workers=args.num_workers,
                        collate_fn=identity, pin_memory=device.type == "cuda")

    model = PairPotential(ntypes=2).to(device)
    with torch.no_grad():  # energy bias from the first batch of every system (least squares)
        stats = [next(iter(ls.dataloaders[sid])) for sid in range(len(ls))]
        counts = np.concatenate([b["natoms"][:, 2:].numpy() for b in stats])
        energies = np.concatenate([b["energy"].numpy().ravel() for b in stats])
        bias = np.linalg.lstsq(counts.astype(np.float64), energies, rcond=None)[0]
        model.bias.copy_(torch.from_numpy(bias))
    ddp_model = DistributedDataParallel(model) if distributed else model  # syncs rank 0's weights
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)

    start = 0
    if args.resume:  # 5. the job's state: any number of ranks; another seed is refused
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["loader"])
        start = ckpt["step"]
    sampler_start = sampler.position  # batches of this rank's stream before this run

    def batches():
        while True:  # each iter() continues the sampler's stream (DeePMD-kit's cycle_iterator)
            yield from loader

    stream = batches()
    for step in range(start, args.steps):
        batch = next(stream)
        energy, force = ddp_model(batch["coord"].to(device), batch["atype"].to(device),
                                  None if batch["box"] is None else batch["box"].to(device))
        natoms = batch["atype"].shape[1]
        loss_e = (((energy - batch["energy"].to(device)) / natoms) ** 2).mean()
        loss_f = ((force - batch["force"].to(device)) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        (loss_e + loss_f).backward()
        optimizer.step()
        if rank == 0 and ((step + 1) % args.disp_freq == 0 or step + 1 == args.steps):
            print(f"step {step + 1:5d}  system {batch['sid']}  frames {batch['fid']}  "
                  f"rmse_e/atom {loss_e.item() ** 0.5:.3e}  rmse_f {loss_f.item() ** 0.5:.3e}",
                  flush=True)

    # 5. Save: the model, the optimizer and every rank's loader state, merged on rank 0.
    # The DataLoader prefetches keys, so save the number of batches *consumed* in this run.
    # gather_to_main is framed: a rank that fails to pickle its state fails every rank.
    states = gather_to_main(sampler.state_dict(consumed=sampler_start + args.steps - start))
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        path = os.path.join(args.output, "checkpoint.pt")
        torch.save({"step": args.steps, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "loader": merge_rank_states(states)},
                   path)
        print(f"saved {path}", flush=True)

    # 6. Full validation: each rank takes its share of the frames, the sums are reduced.
    valid = DpLoaderSet(VALIDATION, batch_size="auto", type_map=["O", "H"])
    valid.add_data_requirement(LABELS)
    sums = {"sse_f": 0.0, "force_terms": 0.0, "frames": 0.0}
    model.eval()
    for batch in DataLoader(valid, sampler=get_validation_sampler(valid), batch_size=None,
                            collate_fn=identity):
        _, force = model(batch["coord"].to(device), batch["atype"].to(device),
                         None if batch["box"] is None else batch["box"].to(device))
        sums["sse_f"] += float(((force - batch["force"].to(device)) ** 2).sum())
        sums["force_terms"] += batch["force"].numel()
        sums["frames"] += len(batch["fid"])
    total = reduce_sums(sums)  # the same numbers on every rank
    if rank == 0:
        print(f"validation rmse_f {(total['sse_f'] / total['force_terms']) ** 0.5:.3e} over "
              f"{total['frames']:.0f} frames", flush=True)
    if distributed:
        dist.barrier()  # gloo: every rank arrives before the group is destroyed
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
