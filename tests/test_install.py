"""A plain, non-editable ``pip install .`` still finds hydra_conf (shipped as package data)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_non_editable_install_ships_hydra_conf(tmp_path):
    venv = tmp_path / "venv"
    # Reuse this interpreter's site-packages for the dependencies; install megapipe itself non-editable.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "venv", "outputs", "multirun",
                                                                 "*.egg-info", "build", "__pycache__", ".hypothesis"))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)],
                   check=True, cwd=tmp_path)
    shutil.rmtree(source)
    probe = (
        "import megapipe, os; from megapipe.config import conf_dir, compose, to_setup;"
        "d = conf_dir(); assert 'site-packages' in d, d;"
        "assert os.path.isfile(os.path.join(d, 'model', 'llama3_70b.yaml'));"
        "print(to_setup(compose(['model=llama3_8b'])).model.num_layers)"
    )
    out = subprocess.run([str(python), "-c", probe], check=True, cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.stdout.strip() == "32"
