"""input.json -> frozen Config: DeePMD-kit names, aliases, defaults, paths and pinned errors."""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
from support.inputs import write_input

from mdloader.config.argcheck import schema_markdown
from mdloader.config.input_json import Config, load_config, parse_config
from mdloader.errors import ConfigError

# DeePMD-kit's examples/water/se_e2_a/input.json, abridged only in its comments.
DEEPMD_INPUT = {
    "_comment": "that's all",
    "model": {
        "type_map": ["O", "H"],
        "descriptor": {"type": "se_e2_a", "sel": [46, 92], "rcut_smth": 0.5, "rcut": 6.0,
                       "neuron": [25, 50, 100], "resnet_dt": False, "axis_neuron": 16,
                       "type_one_side": True, "seed": 1},
        "fitting_net": {"neuron": [240, 240, 240], "resnet_dt": True, "seed": 1},
    },
    "learning_rate": {"type": "exp", "decay_steps": 5000, "start_lr": 0.001,
                      "stop_lr": 3.51e-8},
    "loss": {"type": "ener", "start_pref_e": 0.02, "limit_pref_e": 1, "start_pref_f": 1000,
             "limit_pref_f": 1, "start_pref_v": 0, "limit_pref_v": 0},
    "training": {
        "training_data": {"systems": ["../data/data_0/", "../data/data_1/", "../data/data_2/"],
                          "batch_size": "auto"},
        "validation_data": {"systems": ["../data/data_3"], "batch_size": 1, "numb_btch": 3},
        "numb_steps": 1000000, "seed": 10, "disp_file": "lcurve.out", "disp_freq": 100,
        "save_freq": 1000,
    },
}


def _with(path: str, value: object, base: dict | None = None) -> dict:
    data = copy.deepcopy(DEEPMD_INPUT if base is None else base)
    *parents, last = path.split(".")
    node = data
    for name in parents:
        node = node.setdefault(name, {})
    if value is _DELETE:
        node.pop(last)
    else:
        node[last] = value
    return data


_DELETE = object()


def test_complete_deepmd_input_is_accepted(tmp_path: Path) -> None:
    folder = tmp_path / "se_e2_a"
    folder.mkdir()
    cfg = load_config(write_input(folder, DEEPMD_INPUT))
    assert isinstance(cfg, Config)
    data = str(tmp_path / "data")
    assert cfg.training_data.systems == tuple(os.path.join(data, f"data_{i}") for i in range(3))
    assert cfg.training_data.sampling.batch_size == "auto"
    assert cfg.training_data.sampling.auto_prob == "prob_sys_size"
    assert cfg.validation_data is not None
    assert cfg.validation_data.numb_btch == 3
    assert cfg.validation_data.systems == (os.path.join(data, "data_3"),)
    assert cfg.type_map == ("O", "H")
    assert (cfg.seed, cfg.numb_steps, cfg.disp_freq, cfg.save_freq) == (10, 1000000, 100, 1000)
    assert cfg.learning_rate.stop_lr == 3.51e-8
    assert cfg.loss.start_pref_f == 1000
    assert cfg.source == str(folder / "input.json")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]


def test_defaults_match_deepmd() -> None:
    cfg = parse_config({"training": {"training_data": {"systems": "/d"}}})
    td = cfg.training_data
    spec = td.sampling
    assert (td.systems, spec.batch_size, spec.auto_prob, spec.sys_probs, td.rglob_patterns) == (
        ("/d",), "auto", "prob_sys_size", None, None)
    assert cfg.validation_data is None and cfg.type_map is None and cfg.seed is None
    assert (cfg.numb_steps, cfg.numb_epoch, cfg.disp_freq, cfg.save_freq) == (
        None, None, 1000, 1000)
    assert (cfg.learning_rate.start_lr, cfg.learning_rate.stop_lr,
            cfg.learning_rate.decay_steps) == (1e-3, 1e-8, 5000)
    assert (cfg.loss.start_pref_e, cfg.loss.limit_pref_e, cfg.loss.start_pref_f,
            cfg.loss.limit_pref_f) == (0.02, 1.0, 1000.0, 1.0)


@pytest.mark.parametrize("alias", ["stop_batch", "num_step", "num_steps", "numb_step",
                                   "numb_steps"])
def test_numb_steps_aliases(alias: str) -> None:
    cfg = parse_config({"training": {"training_data": {"systems": "/d"}, alias: 7}})
    assert cfg.numb_steps == 7


def test_keys_starting_with_underscore_are_dropped_everywhere_as_in_deepmd() -> None:
    data = _with("training.training_data._comment7", "that's all")
    data["training"]["validation_data"]["_note"] = {"anything": [1, 2]}
    data["training"]["_comment3"] = "display and restart"
    cfg = parse_config(data)
    assert cfg.training_data.sampling.batch_size == "auto" and cfg.validation_data.numb_btch == 3
    with pytest.raises(ConfigError, match=r"^training\.training_data\.comment: unknown key"):
        parse_config(_with("training.training_data.comment", "no underscore"))


def test_numb_steps_zero_is_accepted_as_in_deepmd() -> None:
    assert parse_config(_with("training.numb_steps", 0)).numb_steps == 0


@pytest.mark.parametrize("alias", ["num_epochs", "num_epoch", "numb_epochs", "numb_epoch"])
def test_numb_epoch_aliases(alias: str) -> None:
    cfg = parse_config({"training": {"training_data": {"systems": "/d"}, alias: 1.5}})
    assert cfg.numb_epoch == 1.5 and cfg.numb_steps is None


def test_data_aliases_and_sampler_params() -> None:
    cfg = parse_config({"training": {
        "training_data": {"systems": ["/a", "/b"], "auto_prob_style": "prob_uniform",
                          "sys_weights": [0.25, -1], "batch_size": [1, 2]},
        "validation_data": {"systems": "/c", "numb_batch": 4},
    }})
    td = cfg.training_data
    assert td.sampling.auto_prob == "prob_uniform" and td.sampling.sys_probs == (0.25, -1.0)
    assert td.sampling.sampler_params() == {"auto_prob": "prob_uniform", "sys_probs": [0.25, -1.0]}
    assert td.sampling.batch_size_value() == [1, 2]
    assert cfg.validation_data is not None and cfg.validation_data.numb_btch == 4
    assert cfg.validation_data.json_path == "training.validation_data"


def test_paths_resolve_against_the_json_folder() -> None:
    cfg = parse_config({"training": {"training_data": {
        "systems": ["rel/sys", "/abs/sys", "../up/f.h5#/grp/a", "f.h5#/"],
        "index_file": "../indexes/train.mdlidx"}, "validation_data": {"systems": "v"}}},
        base_dir="/data/job")
    assert cfg.training_data.systems == (
        "/data/job/rel/sys", "/abs/sys", "/data/up/f.h5#/grp/a", "/data/job/f.h5#/")
    assert cfg.training_data.index_file == "/data/indexes/train.mdlidx"
    assert cfg.validation_data is not None and cfg.validation_data.index_file is None


@pytest.mark.parametrize("rule, held", [("auto", "auto"), ("auto:64", "auto:64"),
                                        ("max:300", "max:300"), ("filter:200", "filter:200"),
                                        (4, 4), ([1, 2], (1, 2))])
def test_good_batch_rules(rule: object, held: object) -> None:
    """Held as given (a list as a tuple, in the frozen config) and handed on as DeePMD-kit
    passes it."""
    data = parse_config(_with("training.training_data.batch_size", rule)).training_data
    assert data.sampling.batch_size == held
    assert data.sampling.batch_size_value() == rule


@pytest.mark.parametrize("style", ["prob_uniform", "prob_sys_size",
                                   "prob_sys_size;0:2:0.3;2:3:0.7", "prob_sys_size; 0:1:1"])
def test_good_prob_styles(style: str) -> None:
    data = parse_config(_with("training.training_data.auto_prob", style)).training_data
    assert data.sampling.auto_prob == style
    assert data.sampling.sampler_params() == {"auto_prob": style}


BAD_CASES = [
    ("training.training_data.batch_size", 1.5,
     r"^training\.training_data\.batch_size: wrong type: expected .*int.*, found float 1\.5$"),
    ("training.training_data.batch_size", "auto:0",
     r"^training\.training_data\.batch_size: Unsupported batch size rule: auto:0 \(N must be >= 1"),
    ("training.training_data.batch_size", "mixed:4",
     r"^training\.training_data\.batch_size: the batch-size rule 'mixed:4' is "
     r"TensorFlow-only \(DeePMD-kit's PyTorch backend refuses it too\)$"),
    ("training.validation_data.batch_size", "max",
     r"^training\.validation_data\.batch_size: Unsupported batch size rule: max \('max' needs"),
    ("training.training_data.batch_size", [2, 0],
     r"training\.training_data\.batch_size: bad value \[2, 0\]"),
    ("training.training_data.batch_size", 0, r"training_data\.batch_size: bad value 0"),
    ("training.training_data.auto_prob", "prob_sys_sze",
     r"training\.training_data\.auto_prob: unknown probability style 'prob_sys_sze': expected "
     r"'prob_uniform'"),
    ("training.training_data.auto_prob", "prob_sys_size;2:1:1",
     r"training\.training_data\.auto_prob: block 2:1:1 in 'prob_sys_size;2:1:1' selects no "
     r"system"),
    ("training.training_data.auto_prob", "prob_sys_size;0:1:-1",
     r"training\.training_data\.auto_prob: block '0:1:-1' in 'prob_sys_size;0:1:-1': the "
     r"weight must be a finite number >= 0"),
    ("training.training_data.sys_probs", ["x"],
     r"training\.training_data\.sys_probs: wrong type: expected list\[float\] \| null, "),
    ("training.training_data.sys_probs", [],
     r"training\.training_data\.sys_probs: bad value \[\]: expected a non-empty list"),
    ("training.training_data.systems", _DELETE,
     r"^training\.training_data\.systems: required key is missing$"),
    ("training.training_data.systems", [],
     r"training\.training_data\.systems: bad value \[\]: expected a non-empty path"),
    ("training.training_data.systems", ["a", 3],
     r"training\.training_data\.systems: wrong type: expected list\[str\] \| str, found list"),
    ("training.training_data.batch_szie", 1,
     r"^training\.training_data\.batch_szie: unknown key \(did you mean: batch_size\?\)$"),
    ("training.training_data.numb_btch", 1, r"^training\.training_data\.numb_btch: unknown key"),
    ("training.validation_data.numb_btch", 0,
     r"^training\.validation_data\.numb_btch: bad value 0: expected a positive integer$"),
    ("training.validation_data.systems", _DELETE,
     r"training\.validation_data\.systems: required key is missing"),
    ("training.training_data.index_file", " ",
     r"^training\.training_data\.index_file: bad value \" \": expected a non-empty path or "
     r"null$"),
    ("training.validation_data.index_file", 3,
     r"^training\.validation_data\.index_file: wrong type: expected null \| str, found int 3$"),
    ("training.training_data.index", "a",
     r"^training\.training_data\.index: unknown key \(did you mean: index_file\?\)$"),
    ("training.training_data.set_prefix", "frames",
     r"training\.training_data\.set_prefix: bad value \"frames\": expected 'set'"),
    ("training.training_data", _DELETE, r"^training\.training_data: required key is missing$"),
    ("training.training_data", "data", r"training\.training_data: wrong type: expected dict"),
    ("training", [], r"^training: wrong type: expected dict, found list \[\]$"),
    ("training.seed", "x", r"training\.seed: wrong type: expected .*int.*found str \"x\""),
    ("training.disp_freq", True, r"training\.disp_freq: bad value true"),
    ("training.save_freq", -1, r"training\.save_freq: bad value -1: expected a positive"),
    ("training.numb_steps", -1, r"training\.numb_steps: bad value -1: expected an integer >= 0"),
    ("training.stop_batch", 5,
     r"^training\.numb_steps: given more than once, as numb_steps and stop_batch$"),
    ("training.numb_epoch", 2,
     r"^training\.numb_steps: numb_steps and numb_epoch are mutually exclusive"),
    ("training.data_dict", {}, r"^training\.data_dict: a multi-task input: mdloader train "
     r"trains one task; train it with `mdloader dp --pt train`"),
    ("model.model_dict", {}, r"^model\.model_dict: a multi-task input: mdloader train"),
    ("model.spin", {"use_spin": [True, False], "spin_norm": [1.27], "virtual_len": [0.4]},
     r"^model\.spin\.spin_norm: TensorFlow spin models \(virtual spin atoms in type\.raw\) are "
     r"not supported by mdloader"),
    ("model.type_map", ["O", "O"],
     r"^model\.type_map: bad value \[\"O\", \"O\"\]: expected a non-empty list of distinct"),
    ("model", 5, r"^model: wrong type: expected dict, found int 5$"),
    ("learning_rate.start_lr", 0, r"^learning_rate\.start_lr: bad value 0"),
    ("loss.start_pref_f", "big", r"^loss\.start_pref_f: wrong type"),
]


@pytest.mark.parametrize("path,value,message", BAD_CASES, ids=[c[0] + "=" + repr(c[1])[:20]
                                                               for c in BAD_CASES])
def test_bad_inputs_name_the_json_path(path: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(_with(path, value))
    assert info.value.path is not None and info.value.path.startswith(path.split(".")[0])


def test_top_level_and_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^the input must be a JSON object, found list$"):
        parse_config([])
    with pytest.raises(ConfigError, match=r"^cannot read the input file .*nope\.json"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"training": {,}}')
    with pytest.raises(ConfigError, match=r"bad\.json is not valid JSON: .* at line 1 column 15"):
        load_config(bad)


def test_deepmd_keys_and_sections_mdloader_does_not_read_pass() -> None:
    """Inside ``model.descriptor`` nothing is checked; a top-level key ``dp`` refuses is refused
    too (tests/config/test_strict_keys.py)."""
    data = _with("training.tensorboard", True)
    data["model"]["descriptor"]["whatever"] = 1
    assert parse_config(data).type_map == ("O", "H")
    data["extra_section"] = {"a": 1}
    with pytest.raises(ConfigError, match=r"^extra_section: unknown key"):
        parse_config(data)


def test_schema_markdown_covers_every_key() -> None:
    text = schema_markdown()
    for key in ("training.training_data.batch_size", "training.validation_data.numb_btch",
                "training.numb_steps", "model.type_map", "`sys_weights`", "`stop_batch`",
                "`auto_prob_style`", "`numb_batch`"):
        assert key in text
    assert text.startswith("| key | type | default | aliases | meaning |")


def test_balance_keys_reach_the_sampler(tmp_path: Path) -> None:
    """training_data.balance_window/balance_cost: checked, and the configured sampler balances."""
    from mdloader.loading.build import Section
    from mdloader.loading.feed import Feed, StreamSpec
    from mdloader.testing import make_dataset
    from mdloader.world import World

    def configured(data):
        spec = StreamSpec(Section.of(None, "training", data.systems, type_map=["O", "H"]),
                          data.sampling)
        return Feed.build([spec], seed=3, world=World(0, 1), labels=[], num_workers=0,
                          type_map=["O", "H"]).stream(None, "training")

    systems = make_dataset(tmp_path, 4, natoms_range=(3, 40), nframes=6)
    raw = {"model": {"type_map": ["O", "H"]},
           "training": {"training_data": {"systems": systems, "batch_size": "auto",
                                          "balance_window": 8}}}
    data = parse_config(raw).training_data
    assert (data.sampling.balance_window, data.sampling.balance_cost) == (8, "atoms")
    built = configured(data)
    assert built.sampler.balance_window == 8 and built.sampler.state_dict()["balance_window"] == 8
    for bad, match in [({"balance_window": -1}, "balance_window: bad value -1"),
                       ({"balance_cost": "pairs"}, "balance_cost: bad value")]:
        wrong = copy.deepcopy(raw)
        wrong["training"]["training_data"].update(bad)
        with pytest.raises(ConfigError, match=match):
            parse_config(wrong)
    needs = copy.deepcopy(raw)
    needs["training"]["training_data"]["balance_cost"] = "neighbours"
    with pytest.raises(ConfigError, match="training.training_data.balance_cost: the cost model "
                       "'neighbours' needs the mean number of neighbours"):
        configured(parse_config(needs).training_data)
