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
