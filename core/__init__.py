"""Shared library: curvature capture, factors, inversion, preconditioners, distribution."""

from core.config import ConfigError, KFACConfig
from core.mkor import MKORConfig, MKORPreconditioner
from core.preconditioner import KFACPreconditioner

__all__ = [
    "ConfigError",
    "KFACConfig",
    "KFACPreconditioner",
    "MKORConfig",
    "MKORPreconditioner",
]
