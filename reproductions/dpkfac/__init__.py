"""DP-KFAC (Zhang et al. 2022): per-update cost at 64 GPUs and convergence at small scale.

* :mod:`~reproductions.dpkfac.tables` rebuilds the comparison (``python -m
  reproductions.dpkfac.tables``);
* :mod:`~reproductions.dpkfac.train` runs the convergence comparison (``python -m
  reproductions.dpkfac.train``).

See ``reproductions/dpkfac/README.md``.
"""
