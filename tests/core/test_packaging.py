"""`pip install .` (a regular, non-editable install) must carry every mapped package and data file."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_contains_the_four_folders_under_one_import_root(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("autodeploy-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "autodeploy/__init__.py",
        "autodeploy/transforms/__init__.py",
        "autodeploy/transforms/match_attention.py",
        "autodeploy/passes/insert_kv_cache.py",
        "autodeploy/serve/__init__.py",
        "autodeploy/pipeline/default.yaml",
    ):
        assert expected in names, expected
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"autodeploy"}, top_level
