"""A multi-task ``input.json`` read as its tasks: shared_dict references, data, weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.inputs import write_input

from mdloader.config.input_json import load_config
from mdloader.config.multitask import JobConfig, load_job, parse_multitask, task_weights
from mdloader.errors import ConfigError


def _multitask(**training: object) -> dict:
    return {
        "model": {
            "shared_dict": {"tm": ["O", "H"],
                            "desc": {"type": "se_e2_a", "rcut": 4.0, "sel": "auto"}},
            "model_dict": {
                "a": {"type_map": "tm", "descriptor": "desc", "fitting_net": {}},
                "b": {"type_map": "tm", "descriptor": "desc:1", "fitting_net": {}},
                "c": {"type_map": ["O", "H"], "fitting_net": {},
                      "descriptor": {"type": "hybrid", "list": ["desc", {"type": "se_e2_r",
                                                                         "rcut": 3.0}]}}},
        },
        "loss_dict": {"a": {"type": "ener", "start_pref_f": 10}},
        "training": {
            "data_dict": {
                "a": {"training_data": {"systems": ["sys0", "sys1"], "batch_size": 1},
                      "validation_data": {"systems": ["sys2"], "batch_size": 1}},
                "b": {"training_data": {"systems": ["sys0", "sys1", "sys2"],
                                        "batch_size": 2}},
                "c": {"training_data": {"systems": "sys0", "batch_size": "auto"}}},
            "numb_steps": 5, "seed": 7, **training},
    }


def test_tasks_resolve_shared_dict_and_keep_the_multitask_json_paths(tmp_path: Path) -> None:
    job = parse_multitask(_multitask(model_prob={"a": 2, "b": 1, "c": 1}),
                          base_dir=str(tmp_path))
    assert job.names == ("a", "b", "c")
    a, b, c = job.tasks
    assert a.config.type_map == b.config.type_map == c.config.type_map == ("O", "H")
    assert a.descriptor == b.descriptor == {"type": "se_e2_a", "rcut": 4.0, "sel": "auto"}
    assert c.descriptor["list"][0] == a.descriptor  # a hybrid's named item too
    assert a.shared == {"type_map": "tm", "descriptor": "desc"}
    assert b.shared["descriptor"] == "desc"  # the share level is not part of the name
    assert a.config.training_data.systems == (str(tmp_path / "sys0"), str(tmp_path / "sys1"))
    assert a.config.training_data.json_path == "training.data_dict.a.training_data"
    assert a.config.validation_data.json_path == "training.data_dict.a.validation_data"
    assert b.config.validation_data is None and b.config.training_data.sampling.batch_size == 2
    assert a.config.seed == b.config.seed == 7 and a.config.numb_steps == 5
    assert a.config.loss.start_pref_f == 10 and b.config.loss.start_pref_f == 1000.0
    assert job.shared_descriptors() == {"desc": ("a", "b", "c")}
    assert job.weights() == {"a": 0.5, "b": 0.25, "c": 0.25}


def test_weights_follow_deepmd_kits_rule() -> None:
    names = ["a", "b"]
    assert task_weights(names, nsystems={"a": 3, "b": 1}) == {"a": 0.75, "b": 0.25}
    assert task_weights(names, num_epoch_dict={"a": 1, "b": 2},
                        nbatches={"a": 10, "b": 20}) == {"a": 0.2, "b": 0.8}
    assert task_weights(names, model_prob={"a": 1, "b": 1},
                        nsystems={"a": 3, "b": 1}) == {"a": 0.5, "b": 0.5}
    with pytest.raises(ConfigError, match=r"^training\.model_prob: no value for task 'b'"):
        task_weights(names, model_prob={"a": 1})
    with pytest.raises(ConfigError, match=r"^training\.model_prob\.b: the weight of task 'b'"):
        task_weights(names, model_prob={"a": 1, "b": -1})
    with pytest.raises(ConfigError, match=r"^training\.model_prob: the weights .* sum to 0"):
        task_weights(names, model_prob={"a": 0, "b": 0})


def test_default_weights_count_the_systems_of_each_task(tmp_path: Path) -> None:
    job = parse_multitask(_multitask(), base_dir=str(tmp_path))
    nsystems = {t.name: len(t.config.training_data.systems) for t in job.tasks}
    assert job.weights(nsystems=nsystems) == pytest.approx(
        {"a": 2 / 6, "b": 3 / 6, "c": 1 / 6})


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["training"]["data_dict"].pop("b"), r"^training\.data_dict\.b: the task has no "
     r"data$"),
    (lambda d: d["training"]["data_dict"].update(z={}), r"^training\.data_dict\.z: 'z' has data "
     r"but no model"),
    (lambda d: d["model"]["model_dict"]["a"].update(descriptor="nope"),
     r"^model\.model_dict\.a\.descriptor: names 'nope', which model\.shared_dict does not hold"),
    (lambda d: d["training"]["data_dict"]["b"]["training_data"].update(batch_size=0),
     r"^training\.data_dict\.b\.training_data\.batch_size: bad value 0"),
    (lambda d: d["training"]["data_dict"]["a"]["training_data"].update(bad=1),
     r"^training\.data_dict\.a\.training_data\.bad: unknown key"),
    (lambda d: d["training"].update(model_prob={"a": 1, "b": 1, "c": 1},
                                    num_epoch_dict={"a": 1, "b": 1, "c": 1}),
     r"^training\.num_epoch_dict: model_prob and num_epoch_dict are mutually exclusive"),
])
def test_bad_multitask_inputs_name_the_json_path(tmp_path: Path, edit: object,
                                                 message: str) -> None:
    data = _multitask()
    edit(data)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=message):
        parse_multitask(data, base_dir=str(tmp_path))


def test_load_job_tells_single_from_multi_task_and_one_config_refuses_it(
        tmp_path: Path) -> None:
    multi = write_input(tmp_path, _multitask(), "multi.json")
    single = write_input(tmp_path, {"model": {"type_map": ["O", "H"]}, "training": {
        "training_data": {"systems": ["sys0"]}, "numb_steps": 1}}, "single.json")
    assert isinstance(load_job(multi), JobConfig)
    assert load_job(single) == load_config(single)
    with pytest.raises(ConfigError, match=r"^model\.model_dict: a multi-task input: mdloader "
                       r"train trains one task; train it with `mdloader dp --pt train`"):
        load_config(multi)
