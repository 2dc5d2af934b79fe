"""Test-wide settings: one thread per process (eigh slows down badly when oversubscribed)."""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
