"""A plain, non-editable ``pip install .`` still finds hydra_conf (shipped as package data)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_non_editable_install_ships_hydra_conf(tmp_path):
    # Install megapipe itself non-editable into a fresh target directory, from a copy of the source that is
    # then deleted; dependencies come from this interpreter's environment.
    source, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "venv", "outputs", "multirun",
                                                                 "*.egg-info", "build", "__pycache__", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, cwd=tmp_path)
    shutil.rmtree(source)
    probe = (
        "import megapipe, os; from megapipe.config import conf_dir, compose, to_scenario;"
        f"d = conf_dir(); assert d.startswith({str(target)!r}), d;"
        "assert os.path.isfile(os.path.join(d, 'model', 'llama3_70b.yaml'));"
        "print(to_scenario(compose(['model=llama3_8b'])).model.num_layers)"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(target)})
    assert out.stdout.strip() == "32"
    assert (target / "bin" / "megapipe").exists()
    source_packages = {os.path.relpath(d, ROOT) for d, _, files in os.walk(os.path.join(ROOT, "megapipe"))
                       if "__init__.py" in files}
    installed = {os.path.relpath(d, target) for d, _, files in os.walk(target / "megapipe") if "__init__.py" in files}
    assert source_packages <= installed, f"list {sorted(source_packages - installed)} under packages in setup.cfg"
