"""Training infrastructure shared by every reproduction's entry point.

* :mod:`~reproductions.common.checkpoint`: atomic checkpoints that survive a crash mid-write.
* :mod:`~reproductions.common.rng`: capture and restore every random generator, for exact resume.
* :mod:`~reproductions.common.results`: the one results-file schema all reproductions write.
* :mod:`~reproductions.common.tracking`: Weights & Biases runs, offline unless logged in.
* :mod:`~reproductions.common.launch`: ``torchrun`` environment, seeding and teardown.
* :mod:`~reproductions.common.scrub`: keeps API keys and tokens out of everything written.
* :mod:`~reproductions.common.tables`: rebuilt paper tables, one schema for all reproductions.

See ``reproductions/common/README.md`` for the results and tables schemas.
"""
