"""Attention backends: implementations of `AttentionBackend`, chosen through the registry."""

from qiao.attention.backends.base import AttentionBackend

__all__ = ["AttentionBackend"]
