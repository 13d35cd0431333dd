"""One build and one statistics pass per ``mdloader dp`` job, for every task.

In process: :func:`~mdloader.loading.build.build_job` gives sections with equal requests one list.
End to end (DeePMD-kit's venv, 1 step each): a three-head se_e2_a input, each head its own
descriptor (``sparse``, ``dense``, and ``twin`` on sparse's systems), trained by DeePMD-kit at
W = 1 (the reference) and by ``mdloader dp`` at W = 1 and W = 2; at W = 2 the input also holds
two heads sharing a descriptor with ``sel: "auto"`` over different data, which DeePMD-kit
cannot train (the heads' ``sel`` differ). Each job's log shows one build and one statistics
pass; every non-shared head's statistics equal DeePMD-kit's one-rank run.

Fine-tuning from the reference, by DeePMD-kit at W = 1 and ``mdloader dp`` at W = 1 and 2 (the
bias statistics in shares): single-task (``--model-branch sparse`` on dense's systems) and
multi-task, whose heads resume ``sparse``, fine-tune from ``dense`` on sparse's systems
(``change-by-statistic``) and start a fitting net afresh (``finetune_head: "RANDOM"``,
``set-by-statistic``) on both data sets; every head's statistics equal DeePMD-kit's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from support.deepmd_env import require_deepmd_python
from support.deepmd_ref import DEEPMD_DP, assert_statistics_equal, run_job, saved_statistics
from support.inputs import write_input

from mdloader.loading.build import Section, build_job
from mdloader.testing import make_dataset

REPO = Path(__file__).resolve().parents[3]
OWN = ("sparse", "dense", "twin")  # each head its own descriptor
SHARED = ("shared_sparse", "shared_dense")  # one descriptor, sel "auto", different data


def test_sections_with_equal_requests_share_one_list(tmp_path: Path) -> None:
    a = make_dataset(tmp_path / "a", 3, nframes=4, seed=1)
    b = make_dataset(tmp_path / "b", 2, nframes=4, seed=2)
    sections = [Section.of("t1", "training", [str(tmp_path / "a")], None, ["O", "H"]),
                Section.of("t2", "training", [str(tmp_path / "a")], None, ["O", "H"]),
                Section.of("t2", "validation", [str(tmp_path / "b")], None, ["O", "H"])]
    job = build_job(sections, index_mode="off")
    assert job.view(sections[0]) is job.view(sections[1])
    assert [d.meta.address for d in job.view(sections[0])] == a
    assert [d.meta.address for d in job.view(sections[2])] == b
    assert job.find(str(tmp_path / "b"), None, ["O", "H"]) is job.view(sections[2])
    assert job.find(str(tmp_path / "c"), None, ["O", "H"]) is None


def _descriptor() -> dict:
    return {"type": "se_e2_a", "sel": "auto", "rcut_smth": 0.5, "rcut": 4.0, "neuron": [4, 8],
            "axis_neuron": 4, "seed": 1}


def _config(root: Path, heads: tuple[str, ...]) -> dict:
    data_of = {"sparse": "sparse", "dense": "dense", "twin": "sparse",
               "shared_sparse": "sparse", "shared_dense": "dense"}
    shared_dict = {"my_type_map": ["O", "H"], "my_descriptor": _descriptor()}
    loss = {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
            "limit_pref_f": 1}

    def head(name: str) -> dict:
        return {"type_map": "my_type_map",
                "descriptor": "my_descriptor" if name in SHARED else _descriptor(),
                "fitting_net": {"neuron": [8], "seed": 1}}

    def data(name: str) -> dict:
        systems = [str(root / data_of[name])]
        section = {"training_data": {"systems": systems, "batch_size": 1}}
        if name != "twin":
            section["validation_data"] = {"systems": list(systems), "batch_size": 1}
        return section

    return {
        "model": {"shared_dict": shared_dict, "model_dict": {h: head(h) for h in heads}},
        "learning_rate": {"type": "exp", "decay_steps": 5, "start_lr": 1e-3, "stop_lr": 1e-5},
        "loss_dict": {h: dict(loss) for h in heads},
        "training": {"model_prob": {h: 1.0 for h in heads},
                     "data_dict": {h: data(h) for h in heads},
                     "numb_steps": 1, "seed": 7, "disp_freq": 1, "save_freq": 1},
    }


def _finetune_job(root: Path, name: str) -> Path:
    """A single-task input on dense's systems, fine-tuned from the reference's sparse head."""
    job = root / name
    job.mkdir()
    config = _config(root, ("dense",))
    config["model"] = {"type_map": ["O", "H"], "descriptor": _descriptor(),
                       "fitting_net": {"neuron": [8], "seed": 1}}
    config["loss"] = config.pop("loss_dict")["dense"]
    training = config["training"]
    config["training"] = {"training_data": training["data_dict"]["dense"]["training_data"],
                          "numb_steps": 1, "seed": 7, "disp_freq": 1, "save_freq": 1}
    write_input(job, config)
    return job


#: the multi-task fine-tune's heads: their data and ``finetune_head`` (none: ``sparse`` resumes
#: the pretrained head of its name; "RANDOM": a new fitting net, the first head's descriptor)
TUNED = {"sparse": (("sparse",), None), "from_dense": (("sparse",), "dense"),
         "fresh": (("sparse", "dense"), "RANDOM")}


def _multitask_finetune_job(root: Path, name: str) -> Path:
    """A multi-task input of the :data:`TUNED` heads, fine-tuned from the reference."""
    job = root / name
    job.mkdir()
    config = _config(root, ("sparse",))
    loss = config["loss_dict"]["sparse"]
    config["model"]["model_dict"], config["loss_dict"] = {}, {}
    config["training"]["model_prob"], config["training"]["data_dict"] = {}, {}
    for head, (data, source) in TUNED.items():
        model = {"type_map": "my_type_map", "descriptor": _descriptor(),
                 "fitting_net": {"neuron": [8], "seed": 1}}
        if source is not None:
            model["finetune_head"] = source
        config["model"]["model_dict"][head] = model
        config["loss_dict"][head] = dict(loss)
        config["training"]["model_prob"][head] = 1.0
        config["training"]["data_dict"][head] = {
            "training_data": {"systems": [str(root / d) for d in data], "batch_size": 1}}
    write_input(job, config)
    return job


def _job(root: Path, name: str, heads: tuple[str, ...]) -> Path:
    job = root / name
    job.mkdir()
    write_input(job, _config(root, heads))
    return job


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DeePMD-kit's one-rank run and ``mdloader dp`` at W = 1 and 2, and fine-tuning from it by
    both (single- and multi-task), each once per module."""
    peer = require_deepmd_python()
    root = tmp_path_factory.mktemp("job")
    make_dataset(root / "sparse", 2, natoms_range=(3, 5), nframes=4, seed=1)
    make_dataset(root / "dense", 2, natoms_range=(20, 24), nframes=4, seed=2)
    reference = _job(root, "deepmd", OWN)
    run_job([peer, "-c", DEEPMD_DP, "--pt", "train", "input.json"], reference)
    one = _job(root, "w1", OWN)
    two = _job(root, "w2", OWN + SHARED)
    two_ranks = [peer, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    train = ["--pt", "train", "input.json"]
    logs = {1: run_job([peer, "-m", "mdloader", "dp", *train], one),
            2: run_job([*two_ranks, "-m", "mdloader", "dp", *train], two)}
    # fine-tuning the reference's sparse head on dense's systems: change-by-statistic
    pretrained = ["--finetune", str(reference / "model.ckpt-1.pt"), "--use-pretrain-script"]
    finetune = [*pretrained, "--model-branch", "sparse"]
    tuned = {"finetune-deepmd": _finetune_job(root, "finetune-deepmd"),
             "multitask-deepmd": _multitask_finetune_job(root, "multitask-deepmd")}
    run_job([peer, "-c", DEEPMD_DP, *train, *finetune], tuned["finetune-deepmd"])
    # multi-task: no --model-branch (each head's finetune_head, or its name, chooses)
    run_job([peer, "-c", DEEPMD_DP, *train, *pretrained], tuned["multitask-deepmd"])
    for world, launch in ((1, [peer]), (2, two_ranks)):
        for kind, make, args in (("finetune", _finetune_job, finetune),
                                 ("multitask", _multitask_finetune_job, pretrained)):
            job = tuned[f"{kind}-mdloader-{world}"] = make(root, f"{kind}-mdloader-{world}")
            logs[kind, world] = run_job([*launch, "-m", "mdloader", "dp", *train, *args], job)
    stats = [saved_statistics(job / "model.ckpt-1.pt") for job in
             [reference, one, two, *tuned.values()]]
    return {"reference": reference, 1: one, 2: two, "logs": logs,
            "stats": dict(zip(["reference", 1, 2, *tuned], stats, strict=True))}


def _own_heads(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if any(f".{h}." in k for h in OWN)}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
def test_one_build_one_statistics_pass_and_deepmd_kits_values(jobs: dict, world: int) -> None:
    log, job = jobs["logs"][world], jobs[world]
    sections = 5 if world == 1 else 9  # twin has no validation; the rest training and validation
    # every task's training and validation systems: two distinct requests, one build
    assert log.count(f"job systems: one build of {sections} sections (2 distinct requests") == 1
    # its report, once: no loader set builds systems of its own
    assert len(re.findall(r"(built|loaded) \d+ systems \(", log)) == 1
    # every task's input statistics in one pass and one all-gather: twin's parts are sparse's
    heads = len(OWN) + (len(SHARED) if world == 2 else 0)
    passes = re.findall(r"statistics pass: (\d+) statistics, (\d+) parts of (\d+) systems .*"
                        r"one all-gather on (\d+) ranks", log)
    assert len(passes) == 1 and passes[0][::3] == (str(2 * heads), str(world))
    # parts: each head's environment and output of 2 systems; twin's are sparse's, and a shared
    # head's output parts are its data's own head's (its environment has the shared sel)
    assert passes[0][1:3] == ("8", "4") if world == 1 else 8 <= int(passes[0][1]) <= 10
    assert log.count("input statistics: all frames of 2 systems") == heads
    resolved = json.loads((job / "out.json").read_text())["model"]["model_dict"]
    reference = json.loads((jobs["reference"] / "out.json").read_text())["model"]["model_dict"]
    for head in OWN:
        assert resolved[head]["descriptor"]["sel"] == reference[head]["descriptor"]["sel"]
    if world == 2:  # one sel for the shared descriptor, though the heads' data differ
        assert resolved["shared_sparse"]["descriptor"]["sel"] == \
            resolved["shared_dense"]["descriptor"]["sel"]
    theirs = _own_heads(jobs["stats"]["reference"])
    ours = _own_heads(jobs["stats"][world])
    assert {k for k in theirs if "out_bias" in k} and {k for k in theirs if ".mean" in k}
    assert_statistics_equal(theirs, ours)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
def test_finetune_bias_in_shares_equals_deepmd_kits_one_rank_run(jobs: dict, world: int) -> None:
    """``--finetune --model-branch`` at W = 1 and 2: every rank predicts its share of the frames
    with the loaded weights, one all-gather, and the changed bias is DeePMD-kit's one-rank value
    (DeePMD-kit's own 2-rank job changes it by rank 0's frames alone)."""
    log = jobs["logs"]["finetune", world]
    assert re.search(rf"prediction statistics: 2 systems .*\(cached 0, computed 2 on {world} "
                     r"ranks", log)
    assert re.search(r"statistics pass: 2 statistics, 4 parts of 2 systems .* one all-gather "
                     rf"on {world} ranks", log)
    theirs, ours = jobs["stats"]["finetune-deepmd"], jobs["stats"][f"finetune-mdloader-{world}"]
    pretrained = jobs["stats"]["reference"]
    bias = [k for k in theirs if "out_bias" in k]
    assert bias and all(theirs[k] != pretrained[k.replace(".Default.", ".sparse.")]
                        for k in bias)  # changed by the new data
    assert_statistics_equal(theirs, ours, neighbours=False)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
def test_multitask_finetune_equals_deepmd_kits_one_rank_run(jobs: dict, world: int) -> None:
    """Multi-task ``--finetune`` at W = 1 and 2: a resumed head keeps its pretrained statistics;
    a head fine-tuned from another changes its bias by the loaded model's predictions in shares,
    and a ``RANDOM`` head sets it from its data; each by one all-gather, equal to DeePMD-kit's."""
    log = jobs["logs"]["multitask", world]
    assert log.count("Model branch sparse will resume training.") == 1
    # from_dense predicts its 2 systems in shares; fresh (set-by-statistic) predicts nothing
    assert len(re.findall(rf"prediction statistics: 2 systems .*\(cached 0, computed 2 on "
                          rf"{world} ranks", log)) == 1
    passes = re.findall(r"statistics pass: (\d+) statistics, (\d+) parts of (\d+) systems .* "
                        r"one all-gather on (\d+) ranks", log)
    assert passes == [("2", "4", "2", str(world)), ("1", "4", "4", str(world))]
    theirs, ours = jobs["stats"]["multitask-deepmd"], jobs["stats"][f"multitask-mdloader-{world}"]
    pretrained = jobs["stats"]["reference"]
    assert {k.split(".")[1] for k in theirs} == set(TUNED)
    resumed = {k: v for k, v in theirs.items() if ".sparse." in k}
    assert resumed and all(v == pretrained[k] for k, v in resumed.items())
    bias = "model.{}.atomic_model.out_bias"
    assert theirs[bias.format("from_dense")] != pretrained[bias.format("dense")]
    fresh = np.asarray(theirs[bias.format("fresh")])  # a new fitting net's bias is zero
    assert np.all(fresh != 0) and all(not np.allclose(fresh, pretrained[bias.format(h)])
                                      for h in OWN)  # set by both data sets, no head's
    assert_statistics_equal(theirs, ours)
