"""megapipe's error hierarchy.

Every error a user can cause derives from :class:`MegapipeError`. The CLI turns
any of them into one line on stderr and exit code 2. Messages show the values
involved and say what to change.
"""

__all__ = ["MegapipeError", "ConfigError", "InfeasibleError", "ProfileError", "ScheduleError"]


class MegapipeError(Exception):
    """Base class for every error megapipe raises on bad input."""


class ConfigError(MegapipeError, ValueError):
    """A configuration value is invalid or inconsistent with another one."""


class InfeasibleError(MegapipeError):
    """No partition or plan satisfies the constraints (memory, divisibility, ...)."""


class ProfileError(MegapipeError, ValueError):
    """A profile file is corrupt, of an unknown format, or does not match the model."""


class ScheduleError(MegapipeError, ValueError):
    """A pipeline schedule cannot be built for the given sizes."""
