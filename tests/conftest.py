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


@pytest.fixture(autouse=True, scope="session")
def _compose_cache(tmp_path_factory):
    """Composed configs are kept in the session's own cache (:mod:`megapipe.config.cache`), never the user's."""
    import os

    from megapipe.config.cache import CACHE_DIR_ENV

    previous = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("compose-cache"))
    yield
    if previous is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = previous
