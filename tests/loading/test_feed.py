"""The feed: one holder of a job's streams, their seed, schedule, worker pool and state.

A multi-task loop run on a feed, as DeePMD-kit's trainer runs it (each step's task from the
feed's schedule, display-time draws outside the training step), reads exactly what it asks
for, ahead, from one pool; every stream serves its own sampler's keys. Saved at any step and
restored into a fresh feed, the job continues with the batches it would have drawn. The
training job's shape (one task, validation, full passes) is read through the same pool.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path

import pytest

from mdloader.errors import ConfigError, StateDictError
from mdloader.loading import feed_state
from mdloader.loading.build import Section
from mdloader.loading.feed import Feed, Stream, StreamSpec
from mdloader.loading.loader import DpLoaderSet, get_sampler_from_params, get_validation_sampler
from mdloader.sampling.loop import TrainingLoop
from mdloader.sampling.order import AgreedSeed
from mdloader.sampling.spec import SamplingSpec
from mdloader.sampling.tasks import task_stream_seed
from mdloader.testing import make_dataset
from mdloader.world import World

TYPE_MAP = ["O", "H"]
TASKS = ("a", "b")
LOOP = TrainingLoop(tasks=TASKS, probs=(0.6, 0.4), disp_freq=3, validation=(2, 1),
                    display_draws=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("feed")
    for i, (name, nsys, nframes) in enumerate([("ta", 2, 6), ("tb", 3, 5), ("va", 1, 4),
                                               ("vb", 2, 3)]):
        make_dataset(root / name, nsys, nframes=nframes, seed=i + 1)
    return root


def multi_feed(root: Path, workers: int, *, seed: int = 5, given: bool = True,
               separate: bool = False) -> Feed:
    """The feed of a two-task job, built as the DeePMD-kit adapter builds it."""
    streams = []
    for task in TASKS:
        for role, folder in (("training", f"t{task}"), ("validation", f"v{task}")):
            data = DpLoaderSet([str(root / folder)], 1, TYPE_MAP,
                               seed=AgreedSeed(task_stream_seed(seed, task), given))
            streams.append(Stream(task, role, data, get_sampler_from_params(data, {})))
    feed = Feed(streams, seed=AgreedSeed(seed, given), world=World(), num_workers=workers,
                separate_pools=separate)
    feed.add_display_streams()
    return feed


def _keys(batch: dict) -> tuple[int, tuple[int, ...]]:
    return int(batch["sid"]), tuple(int(f) for f in batch["fid"])


def run_loop(feed: Feed, steps: int) -> dict[str, list]:
    """``steps`` steps of DeePMD-kit's multi-task loop from the feed's step: what each stream
    gave, by name, and the task of each step."""
    got: dict[str, list] = defaultdict(list)
    draws = {task: feed.draws(task) for task in TASKS}
    for _ in range(steps):
        step = feed.step
        task = TASKS[feed.next_task()]
        got["tasks"].append(task)
        with feed.training_step():
            got[f"training.{task}"].append(_keys(next(draws[task])))
        if LOOP.is_display_step(step):
            for index, other in enumerate(TASKS):
                if other != task:  # outside the training step: a display-time draw
                    got[f"display.{other}"].append(_keys(next(draws[other])))
                for _ in range(LOOP.validation[index]):
                    got[f"validation.{other}"].append(
                        _keys(next(feed.stream(other, "validation"))))
    return dict(got)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_multi_task_loop_reads_ahead_exactly_what_it_asks(data: Path, workers: int) -> None:
    feed = multi_feed(data, workers)
    twins = {s.name: copy.deepcopy(s.sampler) for s in feed.streams.values()}
    feed.start(0, LOOP)
    with feed:
        got = run_loop(feed, 20)
        pool = feed.pools[0]
        assert len(feed.pools) == 1
        assert (pool.unforeseen, pool.most_held) == (0, 0), "every request was foreseen"
    assert not feed.started
    for name, sampler in twins.items():
        dataset = feed.streams[tuple(name.split(".")[::-1])].dataset  # type: ignore[index]
        assert got[name] == [_keys(dataset[sampler.next_key()]) for _ in got[name]], name
    assert got["display.a"] and got["display.b"]
    assert got["display.a"] != got["training.a"][:len(got["display.a"])], "display apart"
    assert set(got["tasks"]) == set(TASKS)


def test_a_pool_per_task_and_kind_of_data_serves_the_same_batches(data: Path) -> None:
    """DeePMD-kit's arrangement (a DataLoader per task and role; display-time draws from the
    training one): the same batches, and each pool reads ahead only its own streams."""
    one, separate = multi_feed(data, 2), multi_feed(data, 2, separate=True)
    one.start(0, LOOP)
    separate.start(0, LOOP)
    with one, separate:
        assert len(separate.pools) == 2 * len(TASKS)
        assert sorted(p.names for p in separate.pools) == sorted(
            [[f"training.{t}", f"display.{t}"] for t in TASKS]
            + [[f"validation.{t}", f"full validation.{t}"] for t in TASKS])
        assert run_loop(separate, 12) == run_loop(one, 12)
        assert all(p.unforeseen == 0 for p in separate.pools), "each pool's own forecast"


@pytest.mark.parametrize(("workers", "given"), [(0, True), (2, True), (2, False)])
def test_saved_at_any_step_a_fresh_feed_continues_exactly(data: Path, workers: int,
                                                          given: bool) -> None:
    """torchdata's test: read k steps, save, drain; a fresh feed restored from the state gives
    exactly the drained rest (an unseeded job adopts the saved seed: schedule and streams)."""
    first = multi_feed(data, workers, seed=5, given=given)
    first.start(0, LOOP)
    with first:
        run_loop(first, 7)
        state = first.gather_state()
        rest = run_loop(first, 9)
    assert state is not None and state["next_step"] == 7 and state["seed"] == 5
    assert set(state["streams"]) == {s.name for s in first.streams.values()}
    fresh = multi_feed(data, workers, seed=5 if given else 9, given=given)
    fresh.start(7, LOOP, state)
    with fresh:
        assert run_loop(fresh, 9) == rest


def test_a_state_that_is_not_this_jobs_changes_nothing(data: Path) -> None:
    feed = multi_feed(data, 0)
    feed.start(0, LOOP)
    run_loop(feed, 4)
    state = feed.gather_state()
    feed.close()
    assert state is not None
    with pytest.raises(StateDictError, match="continues at step 4 but the checkpoint at step 5"):
        multi_feed(data, 0).start(5, LOOP, state)
    with pytest.raises(StateDictError, match=r"seed 5 but this loader has 6 \(training.seed\)"):
        multi_feed(data, 0, seed=6).start(4, LOOP, state)
    partial = {**state, "streams": {k: v for k, v in state["streams"].items()
                                    if k != "validation.b"}}
    with pytest.raises(StateDictError, match=r"no state for the stream\(s\) validation.b"):
        multi_feed(data, 0).start(4, LOOP, partial)
    older = {**state, "streams": {k: v for k, v in state["streams"].items()
                                  if not k.startswith("display.")}}
    restored = multi_feed(data, 0)
    restored.start(4, LOOP, older)  # a state without display streams: they start over
    restored.close()
    with pytest.raises(StateDictError, match="is not an mdloader loader state"):
        multi_feed(data, 0).start(4, LOOP, {"streams": {}})


def test_the_earlier_formats_read_as_this_one() -> None:
    deepmd = {"format": feed_state.DEEPMD_V1, "version": 1, "step": 2, "world_size": 2,
              "streams": {"training": {"x": 1}}, "schedule_seed": 9}
    assert feed_state.read(deepmd) == feed_state.document(
        {"training": {"x": 1}}, next_step=3, world_size=2, seed=9)
    with pytest.raises(StateDictError, match="version 2 of mdloader-deepmd-loader-state"):
        feed_state.read({**deepmd, "version": 2})
    checkpoint = {"step": 6, "world_size": 1, "loader": {"version": 1, "sampler": {"t": 1}},
                  "valid_loader": {"version": 1, "sampler": {"v": 2}}}
    assert feed_state.from_training_checkpoint(checkpoint) == feed_state.document(
        {"training": {"t": 1}, "validation": {"v": 2}}, next_step=6, world_size=1, seed=None)
    assert feed_state.from_training_checkpoint({**checkpoint, "valid_loader": None})[
        "streams"] == {"training": {"t": 1}}


def test_the_training_jobs_feed_builds_once_and_reads_full_passes(data: Path,
                                                                  caplog) -> None:
    """``mdloader train``'s shape: both sections in one build; partial validation and full
    passes through the one pool; a pass cut short leaves the next one whole."""
    specs = [StreamSpec(Section.of(None, "training", [str(data / "tb")], type_map=TYPE_MAP),
                        SamplingSpec(2)),
             StreamSpec(Section.of(None, "validation", [str(data / "vb")], type_map=TYPE_MAP),
                        SamplingSpec(1, json_path="training.validation_data"), seed_offset=1)]
    with caplog.at_level("INFO", logger="mdloader"):
        feed = Feed.build(specs, seed=3, world=World(), labels=[], num_workers=2,
                          type_map=TYPE_MAP)
    assert "job systems: one build of 2 sections (2 distinct requests, 5 systems)" in caplog.text
    assert feed.stream(None, "validation").dataset.seed == 4  # the job seed + 1
    feed.start(0, TrainingLoop(disp_freq=2, validation=(1,), last_display=5))
    with feed:
        expected = [_keys(feed.stream(None, "validation").dataset[k])
                    for k in get_validation_sampler(feed.stream(None, "validation").dataset)]
        for step in range(5):
            with feed.training_step():
                next(feed.stream(None, "training"))
            if step in (0, 1, 3, 4):
                next(feed.stream(None, "validation"))
        whole = [_keys(b) for b in feed.full_pass()]
        cut = feed.full_pass()
        next(cut)
        cut.close()
        again = [_keys(b) for b in feed.full_pass()]
        assert feed.pools[0].unforeseen == 0
    assert whole == again == expected and len(expected) == 6
    with pytest.raises(ConfigError, match="this job has no display stream"):
        feed.stream(None, "display")
