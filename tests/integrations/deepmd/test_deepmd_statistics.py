"""The statistics before the first step under ``mdloader dp --pt train`` equal DeePMD-kit's own.

Each case trains one step twice in its own folder: DeePMD-kit alone (its neighbour statistics on
every rank, its input statistics on rank 0) and ``mdloader dp`` (mdloader's sharded passes).
The resolved ``sel`` (``out.json``), and in the saved model ``min_nbor_dist``, the descriptor's
``mean``/``stddev`` (davg/dstd) and the output bias and standard deviation must agree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from support.deepmd_env import require_deepmd_python
from support.deepmd_ref import DEEPMD_DP, run_job, saved_statistics
from support.inputs import write_input

from mdloader.testing import make_dataset, make_lmdb, make_system

REPO = Path(__file__).resolve().parents[3]


SE_E2_A = {"type": "se_e2_a", "sel": "auto", "rcut_smth": 0.5, "rcut": 4.0, "neuron": [4, 8],
           "axis_neuron": 4, "seed": 1}
DPA1 = {"type": "se_atten", "sel": "auto", "rcut_smth": 0.5, "rcut": 4.0, "neuron": [4, 8],
        "axis_neuron": 4, "attn": 8, "attn_layer": 1, "seed": 1}

DPA2 = {"type": "dpa2", "seed": 1, "add_tebd_to_repinit_out": False,
        "repinit": {"rcut": 4.0, "rcut_smth": 0.5, "nsel": "auto", "neuron": [4, 8],
                    "axis_neuron": 4, "activation_function": "tanh"},
        "repformer": {"rcut": 3.0, "rcut_smth": 0.5, "nsel": "auto", "nlayers": 1,
                      "g1_dim": 8, "g2_dim": 4, "attn2_hidden": 4, "attn2_nhead": 1,
                      "attn1_hidden": 4, "attn1_nhead": 1, "axis_neuron": 4,
                      "update_h2": False}}


def _config(systems: object, descriptor: dict, type_map: list[str]) -> dict:
    return {
        "model": {"type_map": type_map, "descriptor": dict(descriptor),
                  "fitting_net": {"neuron": [8, 8], "seed": 1}},
        "learning_rate": {"type": "exp", "decay_steps": 5, "start_lr": 1e-3, "stop_lr": 1e-5},
        "loss": {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
                 "limit_pref_f": 1},
        "training": {"training_data": {"systems": systems, "batch_size": 1},
                     "numb_steps": 1, "seed": 7, "disp_freq": 1, "save_freq": 1},
    }


def _npy_data(root: Path) -> list[str]:
    systems = make_dataset(root / "data", 3, nframes=6, seed=3)
    systems.append(make_system(root / "data", "free", natoms=7, nframes=4, pbc=False, seed=8))
    return systems


def _lmdb_data(root: Path) -> str:
    systems = make_dataset(root / "src", 3, nframes=5, seed=5)
    return make_lmdb(root / "train.lmdb", systems, type_map=["O", "H"])


def _mixed_data(root: Path) -> list[str]:
    return [make_system(root / "data", f"mixed{i}", natoms=n, nframes=4, mixed_type=True,
                        seed=20 + i, keys=("energy", "force"))
            for i, n in enumerate((10, 14))]


CASES = {
    "se_e2_a-npy-nopbc": (_npy_data, SE_E2_A, ["O", "H"]),
    "se_atten-mixed-type": (_mixed_data, DPA1, ["O", "H"]),
    "se_e2_a-lmdb": (_lmdb_data, SE_E2_A, ["O", "H"]),
    "dpa2-mixed-type": (_mixed_data, DPA2, ["O", "H"]),  # two blocks: repinit, repformer
}


def _subset_data(root: Path, mixed: bool) -> list[str]:
    """12 systems of 10-30 frames and 5-11 atoms (auto:24 gives batch sizes 3-5), so
    ``data_stat_nbatch`` of 2 or 3 batches draws a subset of all but the first; some split in two
    sets, one non-periodic (se_e2_a's data), mixed-type for se_atten."""
    return [make_system(root / "data", f"s{i:02d}", natoms=5 + i % 7, nframes=10 + (20 * i) // 11,
                        nsets=1 + i % 2, pbc=mixed or i != 3, mixed_type=mixed, seed=40 + i,
                        keys=("energy", "force"))
            for i in range(12)]


SUBSET_CASES = {
    "se_e2_a-nbatch2": (False, SE_E2_A, 2),
    "se_atten-mixed-type-nbatch3": (True, DPA1, 3),
}

# DeePMD-kit's own input statistics over mdloader's DpLoaderSet (make_stat_input reads each
# system's per-rank batches): today's path where mdloader does not compute them in shares
DEEPMD_STATISTICS = """import sys
import mdloader.integrations.deepmd as md
md.InputStatTakeover.of = classmethod(lambda cls, *args: None)
sys.exit(md.run_dp(sys.argv[1:]))
"""


def _subset_job(root: Path, name: str, systems: list[str], descriptor: dict,
                nbatch: int) -> Path:
    job = _job(root, name, systems, descriptor, ["O", "H"])
    config = json.loads((job / "input.json").read_text())
    config["model"]["data_stat_nbatch"] = nbatch
    config["training"]["training_data"]["batch_size"] = "auto:24"
    write_input(job, config)
    (job / "deepmd_statistics.py").write_text(DEEPMD_STATISTICS)
    return job


def _model(job: Path) -> dict:
    return saved_statistics(job / "model.ckpt-1.pt")


def _job(root: Path, name: str, systems: object, descriptor: dict, type_map: list[str]) -> Path:
    job = root / name
    job.mkdir()
    write_input(job, _config(systems, descriptor, type_map))
    return job


def _compare(theirs: Path, ours: Path, *, inputs: bool = True) -> None:
    """Equal ``sel`` and ``min_nbor_dist``; with ``inputs`` also the input statistics."""
    descriptor = [json.loads((j / "out.json").read_text())["model"]["descriptor"]
                  for j in (theirs, ours)]
    assert descriptor[0] == descriptor[1]  # the resolved sel (DPA-2: nsel of each block)
    a, b = _model(theirs), _model(ours)
    assert a.keys() == b.keys() and any("min_nbor_dist" in k for k in a)
    for key in a:
        x, y = np.asarray(a[key]), np.asarray(b[key])
        if "min_nbor_dist" in key:
            assert x == y, key  # bit for bit
        elif inputs:
            np.testing.assert_allclose(y, x, rtol=1e-8, atol=1e-12, err_msg=key)


@pytest.fixture(scope="module")
def peer() -> str:
    return require_deepmd_python()


@pytest.fixture(scope="module")
def reference(peer: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """DeePMD-kit's own one-rank run of a case, once per module: its systems and job folder."""
    done: dict[str, tuple[object, Path]] = {}

    def of(case: str) -> tuple[object, Path]:
        if case not in done:
            make, descriptor, type_map = CASES[case]
            root = tmp_path_factory.mktemp(case)
            systems = make(root)
            theirs = _job(root, "deepmd", systems, descriptor, type_map)
            run_job([peer, "-c", DEEPMD_DP, "--pt", "train", "input.json"], theirs)
            done[case] = systems, theirs
        return done[case]

    return of


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_statistics_equal_deepmd_kits_own(peer: str, reference, tmp_path: Path,  # type: ignore
                                          case: str) -> None:
    _, descriptor, type_map = CASES[case]
    systems, theirs = reference(case)
    ours = _job(tmp_path, "mdloader", systems, descriptor, type_map)
    log = run_job([peer, "-m", "mdloader", "dp", "--pt", "train", "input.json"], ours)
    assert "neighbour statistics:" in log and "computed" in log
    assert "environment statistics:" in log and "output statistics:" in log  # mdloader's
    # the neighbour statistics, the input statistics and the loader set read one build
    assert log.count("job systems: one build of 1 sections (1 distinct requests") == 1
    assert len(re.findall(r"(built|loaded) \d+ systems \(", log)) == 1  # its report, once
    assert log.count("statistics pass: ") == 1  # every block and the output: one all-gather
    _compare(theirs, ours)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["se_e2_a-npy-nopbc", "se_atten-mixed-type"])
def test_two_ranks_shard_and_equal_deepmd_kits_own(peer: str, reference,  # type: ignore
                                                   tmp_path: Path, case: str) -> None:
    _, descriptor, type_map = CASES[case]
    systems, theirs = reference(case)
    ours = _job(tmp_path, "mdloader", systems, descriptor, type_map)
    log = run_job([peer, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "-m", "mdloader", "dp", "--pt", "train", "input.json"], ours)
    assert "on 2 ranks" in log and "environment statistics:" in log
    # every rank computed a share of the input statistics: a 2-rank job's davg/dstd/bias are
    # DeePMD-kit's one-rank values (DeePMD-kit's own 2-rank job sees rank 0's frames only)
    _compare(theirs, ours)
    again = run_job([peer, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                     "-m", "mdloader", "dp", "--pt", "train", "input.json"], ours)
    assert f"cached {len(systems)}, computed 0" in again


@pytest.fixture(scope="module")
def subset_reference(peer: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore
    """DeePMD-kit's own statistics path of a subset case at W = 1, once per module."""
    done: dict[str, tuple[list[str], Path]] = {}

    def of(case: str) -> tuple[list[str], Path]:
        if case not in done:
            mixed, descriptor, nbatch = SUBSET_CASES[case]
            root = tmp_path_factory.mktemp(case)
            systems = _subset_data(root, mixed)
            theirs = _subset_job(root, "deepmd", systems, descriptor, nbatch)
            log = run_job([peer, "deepmd_statistics.py", "--pt", "train", "input.json"], theirs)
            assert "input statistics:" not in log and "environment statistics:" not in log
            done[case] = systems, theirs
        return done[case]

    return of


def _subset_reference(subset_reference, root: Path, case: str  # type: ignore[no-untyped-def]
                      ) -> tuple[list[str], Path, Path]:
    """The systems, DeePMD-kit's own statistics run at W = 1 (done) and an mdloader job."""
    _, descriptor, nbatch = SUBSET_CASES[case]
    systems, theirs = subset_reference(case)
    return systems, theirs, _subset_job(root, "mdloader", systems, descriptor, nbatch)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(SUBSET_CASES))
def test_subset_statistics_in_shares_equal_deepmd_kits_path(peer: str, subset_reference,  # type: ignore
                                                            tmp_path: Path, case: str) -> None:
    """``data_stat_nbatch`` draws a subset: mdloader computes the statistics of the frames a
    one-rank job draws, in shares, and the saved model equals DeePMD-kit's own statistics path
    over the same loader; a second run takes every system from the cache."""
    systems, theirs, ours = _subset_reference(subset_reference, tmp_path, case)
    log = run_job([peer, "-m", "mdloader", "dp", "--pt", "train", "input.json"], ours)
    nbatch = SUBSET_CASES[case][2]
    assert re.search(rf"input statistics: \d+ of \d+ frames of 12 systems \(data_stat_nbatch="
                     rf"{nbatch}, the frames of a one-rank job\), in shares on 1 ranks", log)
    assert re.search(r"environment statistics: 12 systems .*\(cached 0, computed 12", log)
    _compare(theirs, ours)
    before = _model(ours)
    again = run_job([peer, "-m", "mdloader", "dp", "--pt", "train", "input.json"], ours)
    assert re.search(r"environment statistics: 12 systems .*\(cached 12, computed 0", again)
    assert re.search(r"output statistics: 12 systems .*\(cached 12, computed 0", again)
    assert _model(ours) == before


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_subset_statistics_on_two_ranks_equal_one_rank(peer: str, subset_reference,  # type: ignore
                                                       tmp_path: Path) -> None:
    """At W = 2 the statistics are the one-rank job's (DeePMD-kit's own path at W = 2 reads
    rank 0's shard only, other frames)."""
    systems, theirs, ours = _subset_reference(subset_reference, tmp_path, "se_e2_a-nbatch2")
    log = run_job([peer, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "-m", "mdloader", "dp", "--pt", "train", "input.json"], ours)
    _compare(theirs, ours)
    assert "in shares on 2 ranks" in log
    assert re.search(r"environment statistics: 12 systems .*\(cached 0, computed 12 on 2", log)


def _fparam_data(root: Path) -> list[str]:
    """8 systems of 10-24 frames with a frame parameter: DeePMD-kit's own statistics path."""
    rng = np.random.default_rng(5)
    return [make_system(root / "data", f"f{i}", natoms=5 + i % 4, nframes=10 + 2 * i, seed=60 + i,
                        keys=("energy", "force"),
                        extra_keys={"fparam": rng.normal(size=(10 + 2 * i, 1))})
            for i in range(8)]


EVERY_FRAME_CASES = {
    # mdloader's shares (an energy model); DeePMD-kit's own action on mdloader's loaders
    "shares": (lambda root: _subset_data(root, mixed=False), 0,
               "input statistics: all frames of 12 systems (MDLOADER_STAT_FRAMES=all), in "
               "shares on 1 ranks"),
    "deepmd-kit's own": (_fparam_data, 1, "input statistics: DeePMD-kit's own on all frames of "
                                          "8 systems (MDLOADER_STAT_FRAMES=all)"),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(EVERY_FRAME_CASES))
def test_every_frame_statistics_equal_deepmd_kits_own_with_every_frame(
        peer: str, tmp_path: Path, case: str) -> None:
    """``MDLOADER_STAT_FRAMES=all`` under ``mdloader dp`` with ``data_stat_nbatch: 2`` (a
    sample of most systems) gives DeePMD-kit's own ``dp`` statistics with a
    ``data_stat_nbatch`` that covers every frame, within 1e-12, on mdloader's shares and on
    DeePMD-kit's own statistics action (a frame parameter); without it the sample's values
    differ."""
    make, numb_fparam, line = EVERY_FRAME_CASES[case]
    systems = make(tmp_path)
    jobs = {}
    for name, nbatch in (("deepmd", 1000), ("mdloader", 2)):
        jobs[name] = _subset_job(tmp_path, name, systems, SE_E2_A, nbatch)
        if numb_fparam:
            config = json.loads((jobs[name] / "input.json").read_text())
            config["model"]["fitting_net"]["numb_fparam"] = numb_fparam
            write_input(jobs[name], config)
    theirs, ours = jobs["deepmd"], jobs["mdloader"]
    run_job([peer, "-c", DEEPMD_DP, "--pt", "train", "input.json"], theirs)
    log = run_job([peer, "-m", "mdloader", "dp", "--pt", "train", "input.json"], ours,
                  MDLOADER_STAT_FRAMES="all")
    assert line in log, log[-3000:]
    every, reference = _model(ours), _model(theirs)
    assert every.keys() == reference.keys()
    for key in reference:
        np.testing.assert_allclose(every[key], reference[key], rtol=1e-12, atol=1e-12,
                                   err_msg=key)
    run_job([peer, "-m", "mdloader", "dp", "--pt", "train", "input.json"], ours,
            MDLOADER_STAT_FRAMES="sample")
    sample = _model(ours)
    assert any(not np.allclose(sample[k], reference[k], rtol=1e-6) for k in reference)
