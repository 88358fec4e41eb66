"""Process start-up: import the compute stack with the cyclic garbage collector paused.

A process that trains or infers imports torch, MONAI and torch's optimizer machinery before
its first step. MONAI's package ``__init__`` executes every submodule (twice) and pulls in
SciPy and matplotlib; torch's first optimizer imports ``torch._dynamo``. Together they build
about a million objects that live as long as the process, and with the collector on, every
full collection during the imports walks all of them again: ~1.5 of the ~8 CPU-s a site or
coordinator process spends before its first round (measured on the 2-core CI machine:
``import torch, monai`` + an optimizer + Flower's SuperNode, 8.1-9.2 CPU-s with the collector
on, 6.5-7.2 paused with the result frozen).

:func:`collector_paused` is the phase: the collector is off inside it, and when the block has
imported modules, everything that exists at its end is moved to the permanent generation
(:func:`gc.freeze`), so later collections do not walk the libraries' objects either. A block
that imported nothing (a test session calling the command line in-process again) freezes
nothing: it would only make whatever garbage the process holds at that moment permanent.
Reference counting frees everything that is not in a cycle at once, paused or not.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off; freeze what exists after it if it imported modules.

    Nested or already-paused uses leave the collector as they found it.
    """
    if not gc.isenabled():
        yield
        return
    modules = len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.freeze()
        gc.enable()


def import_compute_stack() -> None:
    """Import what training and inference use, now, with the collector paused.

    torch, MONAI (its package imports all of it: networks, losses, metrics) and the machinery
    torch's optimizers load on first use (an optimizer over one throwaway tensor is built and
    dropped: that import has no public entry point of its own).
    """
    with collector_paused():
        import monai  # noqa: F401
        import torch

        torch.optim.Adam([torch.zeros(1, requires_grad=True)])
