"""The environment the command benchmarks run megapipe in: a user's machine's.

Python keeps the modules' bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped: pip compiles it at install, an
editable install writes it on its first run), and composed configs are kept between processes in a cache of the
benchmark's own (:mod:`megapipe.config.cache`), which the benchmark's first, separately printed, run fills."""

from __future__ import annotations

import os

from megapipe.config.cache import CACHE_DIR_ENV


def user_environment(cache: str) -> dict[str, str]:
    kept = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return {**kept, "COLUMNS": "200", CACHE_DIR_ENV: cache}
