"""``scripts/deepmd_lmdb_tests.py``: DeePMD-kit's LMDB test files get mdloader's names, and a
test that reaches DeePMD-kit's private helpers or attributes is left out, naming them."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "deepmd_lmdb_tests.py"

SOURCE = textwrap.dedent('''
    from deepmd.dpmodel.utils import lmdb_data
    from deepmd.dpmodel.utils.lmdb_data import (
        LmdbDataReader,
        SameNlocBatchSampler as Sampler,
        _read_metadata,
    )

    def _helper(path):
        return _read_metadata(path)

    def test_public(tmp_path):
        assert LmdbDataReader and Sampler

    def test_through_a_helper(tmp_path):
        _helper(tmp_path)

    class TestThings:
        def setUp(self):
            self.patched = lmdb_data

        def test_inherits_the_set_up(self):
            pass

    def test_private_attribute(reader):
        assert reader._type_remap is None

    def test_merge_rejects_incompatible_type_maps_before_creating_output():
        pass
''')


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("deepmd_lmdb_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_imports_of_the_swapped_names_come_from_mdloader(script) -> None:
    text, kept = script.rewrite(SOURCE)
    assert "from mdloader import (LmdbDataReader, SameNlocBatchSampler as Sampler)" in text
    assert "from deepmd.dpmodel.utils.lmdb_data import (_read_metadata)" in text
    assert kept == {"_read_metadata", "lmdb_data"}
    compile(text, "rewritten.py", "exec")


def test_tests_reaching_deepmd_internals_are_left_out_with_the_names(script) -> None:
    _, kept = script.rewrite(SOURCE)
    assert script.left_out(SOURCE, kept) == {
        "test_through_a_helper": "uses DeePMD-kit's own _read_metadata",
        "TestThings::test_inherits_the_set_up": "uses DeePMD-kit's own lmdb_data",
        "test_private_attribute": "uses DeePMD-kit's own private attribute ._type_remap",
        "test_merge_rejects_incompatible_type_maps_before_creating_output":
            "deliberate difference: " + script.DIFFERENCES[
                "test_merge_rejects_incompatible_type_maps_before_creating_output"],
    }


def test_a_folder_without_the_test_files_is_refused(script, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        script.main([str(tmp_path)])
    assert "is not a DeePMD-kit source checkout" in capsys.readouterr().err
