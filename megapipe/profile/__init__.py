"""Per-layer cost profiles: the ``megapipe-profile/1`` file format and measured profiling.

``Profile`` and its file I/O need no torch; ``megapipe.profile.measure`` does.
"""

from megapipe.profile.format import FORMAT, Profile

__all__ = ["FORMAT", "Profile"]
