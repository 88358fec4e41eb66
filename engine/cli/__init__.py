"""Headless command-line entry points (``fedsm ...``), built on :mod:`engine.api`."""
