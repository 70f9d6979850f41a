"""Opt-in markers: tests marked ``nemo`` run only when selected with ``-m nemo``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    if "nemo" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="needs nemo_toolkit (NEMO_PYTHON=<its python>); run with -m nemo")
    for item in items:
        if "nemo" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Commands run without output.dir write under ./outputs: keep that in the test's own directory."""
    monkeypatch.chdir(tmp_path)
