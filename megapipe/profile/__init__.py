"""Per-layer cost profiles: the ``megapipe-profile/1`` document and measured profiling.

The :class:`~megapipe.records.Profile` record and this document form need no torch;
``megapipe.profile.measure`` does. Its file is read and written by :mod:`megapipe.profile.format`.
"""

from megapipe.profile.format import FORMAT, profile_from_dict, profile_to_dict

__all__ = ["FORMAT", "profile_from_dict", "profile_to_dict"]
