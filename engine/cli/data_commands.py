"""Placeholder until its owner writes it: registers no commands."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's commands to the ``fedsm`` parser."""
