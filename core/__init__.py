"""Shared library: curvature capture, factors, inversion, preconditioners, distribution."""

from core.config import ConfigError, KFACConfig
from core.eva import EvaConfig, EvaPreconditioner
from core.hybrid import HybridConfig, HybridSwitch
from core.mkor import MKORConfig, MKORPreconditioner
from core.optim import SecondOrderOptimizer, build_optimizer
from core.preconditioner import KFACPreconditioner

__all__ = [
    "ConfigError",
    "EvaConfig",
    "EvaPreconditioner",
    "HybridConfig",
    "HybridSwitch",
    "KFACConfig",
    "KFACPreconditioner",
    "MKORConfig",
    "MKORPreconditioner",
    "SecondOrderOptimizer",
    "build_optimizer",
]
