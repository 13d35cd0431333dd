"""A small but real interatomic potential for the reference training job.

The point of ``mdloader train`` is to exercise the loader the way DeePMD-kit's trainer does
(batches of frames, energies and forces, DDP, restart), not to compete with DeePMD models. So
the model is deliberately plain:

* a per-type energy bias fitted by least squares on the training energies (DeePMD-kit's output
  statistics, :mod:`mdloader.train.statistics`), so that the network only learns a small
  residual;
* a smooth atomic correction ``E_i = MLP([G_i, onehot(t_i)])`` where ``G_i`` are Gaussian radial
  functions of the distances to the neighbours of each type inside ``rcut``, multiplied by a
  cosine cutoff, so that the energy and its derivatives go to zero smoothly at ``rcut``;
* forces ``F = -dE/dR`` by autograd.

Periodic boxes use the minimum image convention, valid while ``rcut`` is at most half of the
smallest box height (checked); ``box=None`` (``nopbc`` systems) uses plain distances. Atoms with
a negative type (virtual atoms of mixed-type systems) are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mdloader.errors import DataError


def minimum_image(coord: torch.Tensor, box: torch.Tensor | None, rcut: float) -> torch.Tensor:
    """Pair vectors ``r_j - r_i`` [B, N, N, 3], wrapped to the nearest image when periodic."""
    diff = coord.unsqueeze(1) - coord.unsqueeze(2)
    if box is None:
        return diff
    cell = box.reshape(-1, 3, 3)
    _check_box(cell, rcut)
    frac = torch.einsum("bijx,byx->bijy", diff, torch.linalg.inv(cell).transpose(1, 2))
    frac = frac - torch.round(frac)
    return torch.einsum("bijy,byx->bijx", frac, cell)


def box_heights(cell: torch.Tensor) -> torch.Tensor:
    """The three heights [B, 3] of boxes [B, 3, 3]: the distances between opposite faces."""
    with torch.no_grad():
        volume = torch.linalg.det(cell).abs()
        cross = torch.stack([torch.linalg.cross(cell[:, 1], cell[:, 2]),
                             torch.linalg.cross(cell[:, 2], cell[:, 0]),
                             torch.linalg.cross(cell[:, 0], cell[:, 1])], dim=1)
        return volume.unsqueeze(1) / cross.norm(dim=-1)


def _check_box(cell: torch.Tensor, rcut: float) -> None:
    """Minimum image is exact only while ``rcut`` <= half the smallest box height."""
    smallest = float(box_heights(cell).min())
    if not smallest >= 2 * rcut:
        raise box_too_small(smallest, rcut)


def box_too_small(smallest: float, rcut: float, what: str = "the box", note: str = "",
                  **where: str) -> DataError:
    """The error of a box whose smallest height is under ``2 * rcut`` (``where``: system,
    file)."""
    return DataError(f"{what} is too small for the model cutoff (minimum image needs rcut <= "
                     f"half the smallest box height{note})", expected=f"height >= {2 * rcut:g} A",
                     found=f"{smallest:.4g} A", **where)


class RadialPotential(nn.Module):
    """Energy = per-type bias + MLP of smooth radial features; forces by autograd.

    Parameters
    ----------
    ntypes
        Number of atom types of the model ``type_map``.
    rcut
        Cutoff radius in Angstrom.
    nbasis
        Gaussian radial functions per neighbour type.
    hidden
        Widths of the hidden layers of the atomic network.
    """

    def __init__(self, ntypes: int, *, rcut: float = 4.0, nbasis: int = 16,
                 hidden: Sequence[int] = (32, 32)) -> None:
        super().__init__()
        if ntypes < 1 or rcut <= 0 or nbasis < 1:
            raise ValueError(f"bad model size: ntypes={ntypes}, rcut={rcut}, nbasis={nbasis}")
        self.ntypes, self.rcut, self.nbasis = ntypes, float(rcut), nbasis
        self.register_buffer("centers", torch.linspace(0.5, rcut, nbasis, dtype=torch.float64))
        self.width = (rcut - 0.5) / max(nbasis - 1, 1)
        nfeat = ntypes * nbasis
        self.register_buffer("energy_bias", torch.zeros(ntypes, dtype=torch.float64))
        self.register_buffer("feat_mean", torch.zeros(nfeat, dtype=torch.float64))
        self.register_buffer("feat_std", torch.ones(nfeat, dtype=torch.float64))
        layers: list[nn.Module] = []
        width = nfeat + ntypes
        for size in hidden:
            layers += [nn.Linear(width, size), nn.Tanh()]
            width = size
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers).double()
        with torch.no_grad():  # start from the bias alone: a small last layer
            self.net[-1].weight.mul_(0.01)
            self.net[-1].bias.zero_()

    def features(self, coord: torch.Tensor, atype: torch.Tensor,
                 box: torch.Tensor | None) -> torch.Tensor:
        """Radial features ``G`` [B, N, T * nbasis] (not normalised)."""
        nframes, natoms = atype.shape
        diff = minimum_image(coord, box, self.rcut)
        eye = torch.eye(natoms, dtype=torch.bool, device=coord.device)
        dist2 = (diff * diff).sum(-1) + eye  # self pairs get 1, masked below
        r = torch.sqrt(dist2)
        real = atype >= 0
        pair = (~eye) & real.unsqueeze(1) & real.unsqueeze(2) & (r < self.rcut)
        fc = torch.where(pair, 0.5 * (torch.cos(math.pi * r / self.rcut) + 1.0),
                         torch.zeros_like(r))
        gauss = torch.exp(-(((r.unsqueeze(-1) - self.centers) / self.width) ** 2))
        radial = gauss * fc.unsqueeze(-1)  # [B, N, N, K]
        onehot = nn.functional.one_hot(atype.clamp(min=0), self.ntypes).to(coord.dtype)
        onehot = onehot * real.unsqueeze(-1)
        feats = torch.einsum("bijk,bjt->bitk", radial, onehot)
        return feats.reshape(nframes, natoms, self.ntypes * self.nbasis)

    def forward(self, coord: torch.Tensor, atype: torch.Tensor, box: torch.Tensor | None,
                *, create_graph: bool = True) -> dict[str, torch.Tensor]:
        """Energy [B, 1] and force [B, N, 3] of frames with coordinates [B, N, 3]."""
        coord = coord.detach().to(torch.float64).requires_grad_(True)
        box = None if box is None else box.to(torch.float64)
        atype = atype.long()
        real = atype >= 0
        feats = (self.features(coord, atype, box) - self.feat_mean) / self.feat_std
        onehot = nn.functional.one_hot(atype.clamp(min=0), self.ntypes).to(torch.float64)
        atom = self.net(torch.cat([feats, onehot], dim=-1)).squeeze(-1)
        atom = (atom + self.energy_bias[atype.clamp(min=0)]) * real
        energy = atom.sum(-1, keepdim=True)
        (grad,) = torch.autograd.grad(energy.sum(), coord, create_graph=create_graph)
        return {"energy": energy, "force": -grad, "atom_energy": atom}

    @torch.no_grad()
    def set_statistics(self, bias: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
        """Store the energy bias per type and the mean/std of each feature (a std under 1e-3,
        e.g. of a feature that no pair reaches, is raised to 1e-3 so normalising stays finite)."""
        def put(buffer: torch.Tensor, value: np.ndarray) -> None:
            buffer.copy_(torch.as_tensor(np.asarray(value, dtype=np.float64).reshape(
                buffer.shape), device=buffer.device))

        put(self.energy_bias, bias)
        put(self.feat_mean, mean)
        put(self.feat_std, np.maximum(std, 1e-3))
