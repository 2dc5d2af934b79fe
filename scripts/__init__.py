"""Docs and dashboard generation; run the modules with ``python -m scripts.<name>``."""
