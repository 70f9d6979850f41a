"""Per-layer cost profiles: the ``megapipe-profile/1`` document and measured profiling.

The :class:`~megapipe.records.Profile` record and this document form need no torch;
``megapipe.profile.measure`` does. Files are read and written by :mod:`megapipe.io`.
"""

from megapipe.profile.format import FORMAT, profile_from_dict, profile_to_dict

__all__ = ["FORMAT", "profile_from_dict", "profile_to_dict"]
