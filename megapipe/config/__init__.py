"""Hydra config schemas and the one config -> records function."""

from megapipe.config.build import (DEFAULT_FILL, Setup, compose, conf_dir, recorded_inputs, runtime_file, runtime_of,
                                   to_setup, with_runtime_file)
from megapipe.config.schema import register_configs

__all__ = ["DEFAULT_FILL", "Setup", "compose", "conf_dir", "recorded_inputs",
           "register_configs", "runtime_file", "runtime_of", "to_setup", "with_runtime_file"]
