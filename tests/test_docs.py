"""The docs never lie: the code blocks and commands of the README, docs/ and examples/ run here.

Conventions (also explained on the docs' home page):

* Every fenced block names its language. ``python`` blocks run; the blocks of one page run in
  order as one script, in a scratch folder holding a link to the repository's ``examples/``.
  ``bash`` and ``console`` commands then run, in order, from the same folder (``console``:
  lines starting with ``$ `` are commands, the lines after them the expected output, in which
  ``...`` stands for any text and any run of whitespace matches any other). ``json`` blocks must
  parse to an object, and a ``json`` block with a ``training`` section must pass mdloader's
  ``input.json`` checker, which reads the systems and batch size it shows.
  ``text`` blocks (diagrams, outputs) are shown only.
* An HTML comment right before a block changes how it is tested, visibly in the source:
  ``<!-- docs-test: skip (reason) -->`` (the reason is required),
  ``<!-- docs-test: replace "long" "short" -->`` (e.g. fewer training steps; "long" must occur),
  ``<!-- docs-test: exit N -->`` (the expected exit code of the block's commands),
  ``<!-- docs-test: torchrun N -->`` (a python block that runs alone, under
  ``torchrun --standalone --nproc_per_node=N``).
* ``pip install ... &&`` prefixes are dropped: CI (``.ci/run``) runs the installs themselves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.deepmd_env import require_deepmd_python

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RUN_LANGS = {"python", "bash", "console", "json"}
SHOW_LANGS = {"text"}
MARKER_RE = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
FENCE_RE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)\s*$")
LINK_RE = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
QUOTED = r'"((?:[^"\\]|\\.)*)"'
DIRECTIVES = {
    "skip": re.compile(r"^skip\s*\((.*)\)$"),
    "replace": re.compile(rf"^replace\s+{QUOTED}\s+{QUOTED}$"),
    "exit": re.compile(r"^exit\s+(\d+)$"),
    "torchrun": re.compile(r"^torchrun\s+(\d+)$"),
}
COMMAND_TIMEOUT = 240
# Pages whose long commands are not marked yet by their owner: their structure and links are
# checked, their commands are not run (a visible, reasoned exception, like a skip marker).
NOT_RUN: dict[str, str] = {}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    markers: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def directives(self) -> list[tuple[str, tuple[str, ...]]]:
        out = []
        for text in self.markers:
            for name, rx in DIRECTIVES.items():
                m = rx.match(text)
                if m:
                    out.append((name, tuple(g.replace('\\"', '"') for g in m.groups())))
                    break
            else:
                raise AssertionError(f"{self.where}: unknown docs-test directive {text!r}")
        return out

    @property
    def skipped(self) -> bool:
        return any(name == "skip" for name, _ in self.directives())

    @property
    def expected_exit(self) -> int:
        return next((int(a[0]) for n, a in self.directives() if n == "exit"), 0)

    @property
    def nproc(self) -> int | None:
        """``torchrun N``: this python block runs alone, as a script of N ranks."""
        return next((int(a[0]) for n, a in self.directives() if n == "torchrun"), None)

    def runnable_code(self) -> str:
        code = self.code
        for name, args in self.directives():
            if name == "replace":
                code = code.replace(args[0], args[1])
        return code


def pages() -> list[Path]:
    found = [REPO / "README.md", REPO / "examples" / "water" / "README.md"]
    found += sorted(DOCS.rglob("*.md"))
    return [p for p in found if p.exists()]


def parse_blocks(page: Path) -> list[Block]:
    blocks, markers = [], []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        marker = MARKER_RE.match(lines[i].strip())
        fence = FENCE_RE.match(lines[i])
        if marker:
            markers.append(marker.group(1))
        elif fence:
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j].strip() == fence.group(2)), None)
            assert end is not None, f"{page.relative_to(REPO)}:{i + 1}: unclosed code fence"
            indent = len(fence.group(1))
            code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            blocks.append(Block(page, i + 1, fence.group(3).lower(), code, markers))
            markers, i = [], end
        elif lines[i].strip():
            assert not markers, (f"{page.relative_to(REPO)}:{i + 1}: a docs-test marker must "
                                 "come right before a code block")
        i += 1
    assert not markers, f"{page.relative_to(REPO)}: a docs-test marker after the last block"
    return blocks


ALL_BLOCKS = [b for p in pages() for b in parse_blocks(p)]


def test_every_block_has_a_known_language_and_valid_markers() -> None:
    assert ALL_BLOCKS, "no code blocks found"
    for block in ALL_BLOCKS:
        assert block.lang in RUN_LANGS | SHOW_LANGS, (
            f"{block.where}: code block language {block.lang!r}; use one of "
            f"{sorted(RUN_LANGS | SHOW_LANGS)}")
        for name, args in block.directives():
            if name == "skip":
                assert args[0].strip(), f"{block.where}: docs-test skip needs a reason"
            if name == "replace":
                assert args[0] in block.code, f"{block.where}: {args[0]!r} is not in the block"
            assert block.lang in RUN_LANGS, f"{block.where}: a marker on a {block.lang} block"


def _link_targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK_RE.findall(text) if not re.match(r"^[a-z]+:|^#", t)]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_exist(page: Path) -> None:
    base = page.parent
    for target in _link_targets(page):
        path = (base / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{page.relative_to(REPO)}: broken link {target}"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("rel", ["reference/input-json.md", "reference/cli.md"])
def test_reference_page_is_up_to_date(rel: str) -> None:
    gen = _generator()
    assert (DOCS / rel).read_text(encoding="utf-8") == gen.PAGES[rel](), (
        f"docs/{rel} is out of date: run python docs/gen_reference.py")


def code_env_vars() -> set[str]:
    """Environment variables the package reads: its settings table and ``environ.get("X")``."""
    from mdloader.settings import SETTINGS

    names = {spec.env for spec in SETTINGS.values()}
    for path in (REPO / "mdloader").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        names |= set(re.findall(r'(?:environ|env)\.get\(\s*"([A-Z][A-Z0-9_]+)"', text))
    return names


def test_every_environment_variable_is_documented() -> None:
    names = code_env_vars()
    assert {"MDLOADER_BUILD_WORKERS", "MDLOADER_BUILD_TIMEOUT", "NUM_WORKERS"} <= names
    hpc = (DOCS / "hpc.md").read_text(encoding="utf-8")
    missing = sorted(n for n in names if f"`{n}`" not in hpc)
    assert not missing, f"docs/hpc.md does not document {missing}"
    script = (REPO / "examples" / "water" / "job_slurm.sh").read_text(encoding="utf-8")
    exported = set(re.findall(r"^export ([A-Z0-9_]+)=", script, flags=re.M))
    unknown = sorted(exported - names - {"OMP_NUM_THREADS"})
    assert not unknown, f"job_slurm.sh exports variables no code reads: {unknown}"


JSON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "json"]


def test_the_json_blocks_are_found() -> None:
    """getting-started.md's input and sampling.md's balanced steps at least: without them the
    test below would check nothing and pass."""
    assert len(JSON_BLOCKS) >= 2, [b.where for b in JSON_BLOCKS]


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=lambda b: b.where)
def test_json_blocks_are_valid(block: Block) -> None:
    """A JSON object; with a ``training`` section, one that mdloader's ``input.json`` checker
    accepts and reads as shown: each key of its training data under its own name (the systems
    relative to the repository)."""
    from mdloader.config.input_json import parse_config

    data = json.loads(block.code)
    assert isinstance(data, dict) and data, f"{block.where}: not a JSON object: {data!r}"
    if "training" not in data:
        return
    read = parse_config(data, base_dir=str(REPO)).training_data
    shown = dict(data["training"]["training_data"])
    systems = shown.pop("systems")
    assert read.systems == tuple(os.path.normpath(os.path.join(REPO, s)) for s in
                                 ([systems] if isinstance(systems, str) else systems))
    assert read.sampling.batch_size_value() == shown.pop("batch_size", "auto")
    for key, value in shown.items():
        holder = read.sampling if hasattr(read.sampling, key) else read
        if hasattr(holder, key):  # lists are read as tuples
            assert getattr(holder, key) == (tuple(value) if isinstance(value, list) else value), (
                f"{block.where}: {key}")


def test_example_input_json_is_accepted() -> None:
    from mdloader.config.input_json import load_config

    cfg = load_config(REPO / "examples" / "water" / "input.json")
    assert cfg.type_map == ("O", "H") and cfg.validation_data is not None
    assert [os.path.basename(s) for s in cfg.training_data.systems] == [
        "data_0", "data_1", "data_2"]
    assert cfg.numb_steps and cfg.seed is not None


def test_example_input_json_is_accepted_by_deepmd_kit() -> None:
    """``dp --pt train`` reads the same file: DeePMD-kit's own checker accepts it."""
    python = require_deepmd_python()
    script = ("import json, sys; from deepmd.utils.argcheck import normalize; "
              "print(normalize(json.load(open(sys.argv[1])))['training']['numb_steps'])")
    out = subprocess.run([python, "-c", script, str(REPO / "examples" / "water" / "input.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 0


def test_multitask_example_trains_under_mdloader_dp(tmp_path: Path) -> None:
    """``examples/water/multitask.json`` (two heads sharing a descriptor) trains its few steps
    with DeePMD-kit's trainer under ``mdloader dp``, every head in ``lcurve.out``."""
    python = require_deepmd_python()
    shutil.copy(REPO / "examples" / "water" / "multitask.json", tmp_path / "multitask.json")
    (tmp_path / "data").symlink_to(REPO / "examples" / "water" / "data")
    env = dict(_env(), MDLOADER_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([python, "-m", "mdloader", "dp", "--pt", "train", "multitask.json"],
                         cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT)
    assert out.returncode == 0, out.stdout[-4000:]
    rows = (tmp_path / "lcurve.out").read_text().splitlines()
    assert "rmse_trn_water_a" in rows[0] and "rmse_trn_water_b" in rows[0]
    assert [r.split()[0] for r in rows if not r.startswith("#")] == ["1", "2", "4"]
    assert (tmp_path / "model.ckpt-4.pt").exists()


# -- running commands ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = tmp_path_factory.mktemp("docs")
    (ws / "examples").symlink_to(REPO / "examples")
    return ws


def _env() -> dict[str, str]:
    bindir = os.path.dirname(sys.executable)
    return dict(os.environ, PYTHONUNBUFFERED="1", PATH=bindir + os.pathsep + os.environ["PATH"],
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", NUM_WORKERS=os.environ.get("NUM_WORKERS", "0"))


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=COMMAND_TIMEOUT)


def logical_lines(code: str) -> list[str]:
    out, current = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.lstrip().startswith("#"):
            out.append(current.strip())
        current = ""
    return out


PIP_PREFIX = re.compile(r"^(?:pip install [^&]*&&\s*)+")


def bash_commands(block: Block) -> list[tuple[str, str | None]]:
    """(command, expected output or None) pairs of a bash or console block."""
    code = block.runnable_code()
    if block.lang == "bash":
        commands = [(PIP_PREFIX.sub("", c), None) for c in logical_lines(code)]
    else:
        commands, lines = [], code.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("$ "):
                cmd = line[2:]
                rest = lines[i + 1:]
                while cmd.endswith("\\") and rest:
                    cmd, rest = cmd[:-1] + " " + rest[0].strip(), rest[1:]
                want = []
                for nxt in rest:
                    if nxt.startswith("$ "):
                        break
                    want.append(nxt)
                commands.append((PIP_PREFIX.sub("", cmd), "\n".join(want)))
    for cmd, _ in commands:
        assert not cmd.startswith(("pip ", "git ", "sbatch", "srun")), (
            f"{block.where}: {cmd!r} cannot run in a test: mark the block with a skip reason")
    return commands


def output_matches(want: str, got: str) -> bool:
    """``...`` stands for any text (lines included); any run of whitespace matches any other."""
    parts = []
    for literal in want.split("..."):
        words = literal.split()
        parts.append(r"\s+".join(re.escape(w) for w in words) if words else "")
    pattern = r"\s*" + r".*?".join(rf"\s*{p}\s*" if p else "" for p in parts) + r"\s*"
    return re.fullmatch(pattern, got, flags=re.S) is not None

_done: dict[str, subprocess.CompletedProcess] = {}


def run_block_commands(block: Block, cwd: Path) -> None:
    for cmd, want in bash_commands(block):
        key = f"{cmd}\0{cwd}"
        if key not in _done or want is not None:  # identical long commands run once
            _done[key] = _run(cmd, cwd)
        out = _done[key]
        assert out.returncode == block.expected_exit, (
            f"{block.where}: `{cmd}` exited {out.returncode} (expected {block.expected_exit}):"
            f"\n{out.stdout[-4000:]}")
        if want:
            assert output_matches(want, out.stdout), (
                f"{block.where}: output of `{cmd}` differs from the page:\n--- page\n{want}\n"
                f"--- real\n{out.stdout}")


RUN_PAGES = [p for p in pages() if str(p.relative_to(REPO)) not in NOT_RUN
             and any(b.lang in {"python", "bash", "console"} and not b.skipped
                    for b in parse_blocks(p))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_page_runs(page: Path, workspace: Path) -> None:
    blocks = [b for b in parse_blocks(page) if not b.skipped]
    script = "\n".join(b.runnable_code() for b in blocks if b.lang == "python" and not b.nproc)
    if script:
        path = workspace / f"docs_{page.stem.replace('-', '_')}.py"
        path.write_text(script, encoding="utf-8")
        out = subprocess.run([sys.executable, str(path)], cwd=workspace, env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=COMMAND_TIMEOUT)
        assert out.returncode == 0, (f"python blocks of {page.relative_to(REPO)} failed:\n"
                                     f"{out.stdout[-4000:]}")
    for block in blocks:
        if block.lang in {"bash", "console"}:
            run_block_commands(block, workspace)
        elif block.lang == "python" and block.nproc:
            path = workspace / f"docs_{page.stem.replace('-', '_')}_{block.line}.py"
            path.write_text(block.runnable_code(), encoding="utf-8")
            out = _run(f"torchrun --standalone --nproc_per_node={block.nproc} {path.name}",
                       workspace)
            assert out.returncode == 0, f"{block.where} under torchrun:\n{out.stdout[-4000:]}"


# -- the Slurm script, with stand-ins for srun and scontrol ----------------------------------
FAKE_SRUN = """#!/bin/bash
# stand-in for srun: drop srun's options, run the command once on this machine
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_job_slurm_script_runs_with_a_stand_in_srun(tmp_path: Path) -> None:
    """The script runs; its time-limit signal (SIGUSR1, from ``--signal=B:USR1@120``) stops the
    ranks after a step with a checkpoint and requeues the job, which then continues from it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/scontrol.log\n'
                                   'echo localhost\n')
    for tool in fake.iterdir():
        tool.chmod(0o755)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = dict(_env(), PATH=f"{fake}{os.pathsep}{_env()['PATH']}", SLURM_JOB_ID="7",
               SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_CPUS_PER_TASK="2",
               NPROC_PER_NODE="2", NUM_WORKERS="0", RDZV_PORT=str(_free_port()))
    env.pop("OMP_NUM_THREADS")
    script = REPO / "examples" / "water" / "job_slurm.sh"
    run = tmp_path / "runs" / "water-7"
    job = subprocess.Popen(["bash", str(script), "--numb-steps", "400"], cwd=tmp_path, env=env,
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        while not ((run / "lcurve.out").exists() and
                   len((run / "lcurve.out").read_text().splitlines()) > 1):
            assert job.poll() is None, job.communicate()[0][-4000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # what Slurm sends 120 s before the time limit
        out = job.communicate(timeout=COMMAND_TIMEOUT)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert "1 node(s) x 2 rank(s)" in out and "OMP_NUM_THREADS=1" in out
    assert "requeueing job 7" in out and job.returncode == 143, out[-4000:]
    assert f"latest checkpoint: {os.readlink(run / 'model.ckpt.pt')};" in out, out[-4000:]
    assert (tmp_path / "scontrol.log").read_text().splitlines()[-1] == "requeue 7"
    step = int(os.readlink(run / "model.ckpt.pt")[len("model.ckpt-"):-len(".pt")])
    assert "saved checkpoint" in (run / "train.log").read_text()
    assert sorted(p.parent.name for p in run.glob("torchrun/*/attempt_0/*/stderr.log")) == [
        "0", "1"]
    again = subprocess.run(["bash", str(script), "--numb-steps", str(step + 1)], cwd=tmp_path,
                           env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=COMMAND_TIMEOUT)  # the requeued job: same id, same folder
    assert again.returncode == 0, again.stdout[-4000:]
    assert f"restarted from {run.relative_to(tmp_path)}/model.ckpt.pt at step {step}" in \
        (run / "train.log").read_text()
    steps = [line.split()[0] for line in (run / "lcurve.out").read_text().splitlines()[1:]]
    assert steps == ["1", str(step + 1)]


def test_job_slurm_script_is_valid_bash() -> None:
    script = REPO / "examples" / "water" / "job_slurm.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK)


# -- the site ------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed")
@pytest.mark.timeout(120)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=110)
    assert out.returncode == 0, out.stdout[-4000:]
    assert (tmp_path / "site" / "index.html").exists()


SETUP_COMMANDS = [
    "pip install torch==2.13.0 && pip install -e . && torchrun --standalone --nproc_per_node=2 "
    "-m mdloader train examples/water/input.json --numb-steps 200 --output runs/water",
    'pip install torch==2.13.0 && pip install -e ".[test]" && bash scripts/deepmd-env.sh && '
    'python -m pytest -q',
]


def test_readme_setup_commands() -> None:
    """The two set-up commands stay as they are, in the README and in .ci/run."""
    readme = REPO / "README.md"
    commands = [c for b in parse_blocks(readme) if b.lang == "bash"
                for c in logical_lines(b.code) if c.startswith("pip install")]
    assert commands[:2] == SETUP_COMMANDS, f"README.md: {commands[:2]}"
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert SETUP_COMMANDS[1] in ci


def test_readme_figures_come_from_the_benchmark_results() -> None:
    """The README's numbers are filled in by ``python -m benchmarks.report`` from the same
    results as docs/benchmarks.md, so they cannot drift apart (like the reference pages)."""
    from benchmarks import aggregate
    from benchmarks.fs_traffic import report as fs_traffic_report
    from benchmarks.report import BENCH_MARK, fill_readme
    from benchmarks.startup.report import readme_figures

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    _, rows = aggregate.load_many(sorted(str(p) for p in
                                         (REPO / "benchmarks" / "results").glob("*.jsonl")))
    figures = {**readme_figures(rows), **fs_traffic_report.readme_figures()}  # as report.py
    assert len(BENCH_MARK.findall(readme)) >= 20
    assert readme == fill_readme(readme, figures), (
        "README.md is out of date: run python -m benchmarks.report benchmarks/results/*.jsonl")
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    for name in ("md_bytes_2000", "dp_bytes_2000"):
        assert figures[name] in page, f"docs/benchmarks.md does not show {figures[name]}"


def test_a_plotted_series_hidden_by_another_is_left_out_of_the_legend() -> None:
    from benchmarks.plots import visible

    shown = [(100, 6.0), (2000, 17.3)]
    assert not visible([2000], [17.6], shown)  # W = 4 on top of W = 2: not drawn, not listed
    assert visible([2000], [20.2], shown) and visible([100, 2000], [6.0, 1.4], shown)
