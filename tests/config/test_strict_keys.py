"""Every section of input.json that mdloader reads is checked strictly, as ``dp`` checks it: a
misspelt key is refused with "did you mean" (before: accepted, and its default silently used),
DeePMD-kit's own keys pass through, ``_*`` keys are dropped."""

from __future__ import annotations

import json
import subprocess

import pytest
from support.deepmd_env import require_deepmd_python

from mdloader.config.argcheck import DEEPMD_KEYS
from mdloader.config.input_json import parse_config
from mdloader.config.unsupported import refuse_under_deepmd, take_mdloader_keys
from mdloader.errors import ConfigError
from mdloader.testing import make_system


def _input(**sections: dict) -> dict:
    data: dict = {"model": {"type_map": ["O", "H"]},
                  "training": {"training_data": {"systems": ["sys"], "batch_size": 1}}}
    for name, extra in sections.items():
        target = data if name == "root" else data.setdefault(name, {})
        target.update(extra)
    return data


@pytest.mark.parametrize("section, key, message", [
    ("training", "batch_szie", r"^training\.batch_szie: unknown key"),
    ("training", "sav_freq", r"^training\.sav_freq: unknown key \(did you mean: save_freq\?\)$"),
    ("model", "type_mapp", r"^model\.type_mapp: unknown key \(did you mean: type_map\?\)$"),
    ("learning_rate", "start_rl", r"^learning_rate\.start_rl: unknown key \(did you mean: "
                                  r"start_lr\?\)$"),
    ("loss", "start_pref_ff", r"^loss\.start_pref_ff: unknown key \(did you mean: "
                              r"start_pref_f\?\)$"),
    ("root", "learning_rat", r"^learning_rat: unknown key \(did you mean: learning_rate\?\)$"),
])
def test_a_misspelt_key_is_refused_with_did_you_mean(tmp_path, section, key, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(_input(**{section: {key: 2}}), base_dir=str(tmp_path))


def test_deepmd_keys_pass_through_and_underscore_keys_are_dropped(tmp_path) -> None:
    make_system(tmp_path, "sys")
    config = parse_config(_input(
        root={"optimizer": {"type": "Adam", "anything": 1}, "_note": 1,
              "validating": {"validation_freq": 5}},
        model={"descriptor": {"type": "se_e2_a", "rcut": 6.0, "_c": 1}, "fitting_net": {},
               "_comment": "x"},
        learning_rate={"decay_rate": 0.9, "_c": 1},
        loss={"start_pref_v": 0.0, "limit_pref_v": 1.0, "_c": 1},
        training={"numb_test": 1, "tensorboard": True, "save_freq": 7, "_c": 1}),
        base_dir=str(tmp_path))
    assert config.save_freq == 7 and config.type_map == ("O", "H")


def test_the_passed_through_keys_are_deepmd_kits() -> None:
    """The lists are DeePMD-kit 3.2's keys of each section (every variant), less what mdloader
    declares itself, plus the legacy keys ``dp`` moves or drops."""
    code = r"""
import json
from deepmd.utils.argcheck import gen_args
def names(arg):
    out = set()
    def fields(sub):
        for s in sub.values():
            out.add(s.name); out.update(s.alias)
    def variants(a):
        for v in a.sub_variants.values():
            out.add(v.flag_name)
            for choice in v.choice_dict.values():
                fields(choice.sub_fields); variants(choice)
    fields(arg.sub_fields); variants(arg)
    return sorted(out)
args = gen_args(multi_task=False)
found = {"": sorted(n for a in args for n in (a.name, *a.alias))}
found.update({a.name: names(a) for a in args if a.name in ("model", "learning_rate", "loss",
                                                            "training")})
print(json.dumps(found))
"""
    out = subprocess.run([require_deepmd_python(), "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    deepmd = json.loads(out.strip().splitlines()[-1])
    from mdloader.config.argcheck import input_schema

    schema = input_schema()
    legacy = {"numb_test", "warmup_steps", "warmup_ratio", "warmup_start_factor", "opt_type",
              "kf_blocksize", "kf_start_pref_e", "kf_limit_pref_e", "kf_start_pref_f",
              "kf_limit_pref_f", "weight_decay", "momentum", "muon_momentum", "adam_beta1",
              "adam_beta2", "lr_adjust", "lr_adjust_coeff", "muon_2d_only", "min_2d_dim"}
    for section, keys in deepmd.items():
        arg = schema if not section else schema.sub_fields[section]
        ours = {n for sub in arg.sub_fields.values() if sub.name not in DEEPMD_KEYS[section]
                for n in (sub.name, *sub.alias)}
        expected = set(keys) - ours | (legacy if section == "training" else set())
        assert set(DEEPMD_KEYS[section]) == expected, section


@pytest.mark.parametrize("prefix", ["training", "training.data_dict.water"])
@pytest.mark.parametrize("section", ["training_data", "validation_data"])
def test_under_mdloader_dp_a_key_only_mdloader_train_reads_is_refused_by_its_path(
        prefix: str, section: str) -> None:
    """In any data section of any task, one line naming the key's JSON path (a launch of
    ``mdloader dp`` checks it comes before any set-up: tests/integrations/deepmd)."""
    data = _holding(prefix, section, "index_file", "index.json")
    refuse_under_deepmd({"training": {"training_data": {"systems": ["sys"]}}})
    with pytest.raises(ConfigError, match=rf"^{prefix}\.{section}\.index_file: read by "
                                          r"mdloader train only: .*which does not know "
                                          r"index_file; remove it"):
        refuse_under_deepmd(data)


def _holding(prefix: str, section: str, key: str, value: object) -> dict:
    """An input whose ``section`` of the task at ``prefix`` holds ``key: value``."""
    data: dict = {"training": {}}
    holder = data["training"]
    if prefix != "training":
        holder = holder.setdefault("data_dict", {}).setdefault("water", {})
    holder["training_data"] = {"systems": ["sys"]}
    holder.setdefault(section, {"systems": ["sys"]})[key] = value
    return data


@pytest.mark.parametrize("key, value", [("balance_window", 4), ("balance_cost", "atoms")])
def test_under_mdloader_dp_balance_keys_act_in_training_data_and_are_taken_out(
        key: str, value: object) -> None:
    """Single-task: accepted, and taken out of a copy for DeePMD-kit's strict check."""
    data = _holding("training", "training_data", key, value)
    refuse_under_deepmd(data, task_draw="per-rank")
    stripped, taken = take_mdloader_keys(data)
    assert taken == {"training.training_data": {key: value}}
    assert key not in stripped["training"]["training_data"]
    assert data["training"]["training_data"][key] == value  # the user's input is left alone
    assert take_mdloader_keys(stripped) == (stripped, {})


@pytest.mark.parametrize("prefix", ["training", "training.data_dict.water"])
def test_under_mdloader_dp_a_balance_key_outside_training_data_is_refused(prefix: str) -> None:
    data = _holding(prefix, "validation_data", "balance_window", 4)
    with pytest.raises(ConfigError, match=rf"^{prefix}\.validation_data\.balance_window: "
                                          r"balanced steps apply to training data"):
        refuse_under_deepmd(data, task_draw="same")


def test_under_mdloader_dp_the_neighbours_cost_is_refused() -> None:
    data = _holding("training", "training_data", "balance_cost", "neighbours")
    with pytest.raises(ConfigError, match=r"^training\.training_data\.balance_cost: mdloader dp "
                                          r"balances the atoms of a batch"):
        refuse_under_deepmd(data)


def test_a_multi_task_balance_window_needs_the_same_task_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-rank task draws (DeePMD-kit's rule, the default) are refused naming the key and
    the setting that allows it; the same task on every rank acts."""
    data = _holding("training.data_dict.water", "training_data", "balance_window", 8)
    line = (r"^training\.data_dict\.water\.training_data\.balance_window: balanced steps of a "
            r"multi-task job need the same task on every rank at each step; set "
            r"MDLOADER_TASK_DRAW=same ")
    with pytest.raises(ConfigError, match=line):
        refuse_under_deepmd(data, task_draw="per-rank")
    monkeypatch.delenv("MDLOADER_TASK_DRAW", raising=False)
    with pytest.raises(ConfigError, match=line):
        refuse_under_deepmd(data)
    monkeypatch.setenv("MDLOADER_TASK_DRAW", "same")
    refuse_under_deepmd(data)
    refuse_under_deepmd(data, task_draw="same")
    data["training"]["data_dict"]["water"]["training_data"]["balance_window"] = 0  # off
    refuse_under_deepmd(data, task_draw="per-rank")


MIX_LINE = (r"Unsupported batch size rule: mix:4 \(DeePMD-kit 3\.2's LMDB rule for batches of "
            r"mixed atom counts; DpLoaderSet does not implement mix:N \(its batches come from one "
            r"system\): train it with mdloader train or mdloader dp on an LMDB database")


@pytest.mark.parametrize("rule, message", [
    ("mix:4", r"mix:N batches frames of different atom counts from one LMDB database "
              r"\(DeePMD-kit 3\.2's rule\); these systems are sys: a batch of npy or HDF5 data "
              r"comes from one system"),
    ("mix:x", r"Unsupported batch_size 'mix:x'\. Expected 'mix:N' with N a positive integer"),
    ("mixed:4", r"the batch-size rule 'mixed:4' is TensorFlow-only"),
    ("max", r"Unsupported batch size rule: max \('max' needs ':N'"),
    ("often:2", r"Unsupported batch size rule: often:2$"),
])
@pytest.mark.parametrize("prefix", ["training", "training.data_dict.water"])
@pytest.mark.parametrize("section", ["training_data", "validation_data"])
def test_under_mdloader_dp_a_batch_rule_mdloader_does_not_serve_is_refused_by_its_path(
        rule: str, message: str, prefix: str, section: str) -> None:
    """``mdloader dp`` used to find these in its set-up, after the neighbour statistics; its
    pre-flight now names the rule's full JSON path, in any data section of any task."""
    data: dict = {"training": {}}
    holder = data["training"]
    if prefix != "training":
        holder = holder.setdefault("data_dict", {}).setdefault("water", {})
    holder["training_data"] = {"systems": ["sys"], "batch_size": "auto:8"}
    holder.setdefault(section, {"systems": ["sys"]})["batch_size"] = rule
    with pytest.raises(ConfigError, match=rf"^{prefix}\.{section}\.batch_size: {message}"):
        refuse_under_deepmd(data)
    holder[section]["batch_size"] = "filter:64"
    refuse_under_deepmd(data)
    holder[section].update(batch_size="mix:64", systems="train.lmdb")  # one LMDB database
    refuse_under_deepmd(data)


@pytest.mark.parametrize("multitask", [False, True])
def test_mix_is_refused_by_its_full_path_when_the_input_is_read(multitask: bool) -> None:
    """Where mix:N is not served (``mdloader bench``, ``stat``, ``index``, DpLoaderSet) the
    input is read through the same configuration: the same line, the task's path in a
    multi-task input. ``mdloader train`` and ``check`` read it on one LMDB database
    (tests/train/test_train_mix.py)."""
    from mdloader.config.multitask import parse_multitask

    data = _input()
    data["training"]["training_data"]["batch_size"] = "mix:4"
    prefix = "training"
    if multitask:
        data["model"] = {"model_dict": {"water": {"type_map": ["O", "H"]}}}
        data["training"] = {"data_dict": {"water": data["training"]}}
        prefix = "training.data_dict.water"
    with pytest.raises(ConfigError, match=rf"^{prefix}\.training_data\.batch_size: {MIX_LINE}"):
        (parse_multitask if multitask else parse_config)(data)


def test_a_full_validation_of_mix_batches_is_refused_before_any_set_up() -> None:
    """The full pass reads the validation systems frame by frame: mix:N batches there used to
    be refused only when the first pass began, after the whole set-up."""
    data = {"training": {"training_data": {"systems": ["train.lmdb"]},
                         "validation_data": {"systems": ["valid.lmdb"], "batch_size": "mix:8"}},
            "validating": {"full_validation": True}}
    with pytest.raises(ConfigError, match=r"^training\.validation_data\.batch_size: a full "
                                          r"validation reads the validation systems frame by"):
        refuse_under_deepmd(data)
