"""Hydra config schemas and the one config -> records function."""

from megapipe.config.build import DEFAULT_FILL, SEARCHABLE, Setup, compose, conf_dir, to_setup
from megapipe.config.schema import register_configs

__all__ = ["DEFAULT_FILL", "SEARCHABLE", "Setup", "compose", "conf_dir", "register_configs", "to_setup"]
