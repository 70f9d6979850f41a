"""Hydra config schemas and the one config -> records function."""

from megapipe.config.build import (DEFAULT_FILL, Scenario, compose, conf_dir, extra_of, recorded_inputs, runtime_file,
                                   runtime_of, stage_times_of, to_scenario, with_runtime_file)
from megapipe.config.schema import register_configs

__all__ = ["DEFAULT_FILL", "Scenario", "compose", "conf_dir", "extra_of", "recorded_inputs",
           "register_configs", "runtime_file", "runtime_of", "stage_times_of", "to_scenario", "with_runtime_file"]
