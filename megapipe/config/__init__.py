"""Hydra config schemas and the one config -> records function."""

from megapipe.config.build import DEFAULT_FILL, Setup, compose, conf_dir, recorded_inputs, to_setup
from megapipe.config.options import OutputOptions, ReplanOptions
from megapipe.config.schema import register_configs

__all__ = ["DEFAULT_FILL", "OutputOptions", "ReplanOptions", "Setup", "compose", "conf_dir", "recorded_inputs",
           "register_configs", "to_setup"]
