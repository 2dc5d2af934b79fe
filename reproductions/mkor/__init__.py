"""Reproduction of Mozaffari et al., "MKOR" (NeurIPS 2023): BERT pre-training with LAMB, K-FAC,
MKOR, MKOR-H and Eva (``python -m reproductions.mkor.bert``) and the paper's tables
(``python -m reproductions.mkor.tables``). See README.md in this directory."""
