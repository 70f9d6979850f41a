"""Unit constants, one home each."""

__all__ = ["GIB"]

GIB = 2**30
"""Bytes per GiB (what nvidia-smi and torch.cuda report memory in)."""
