"""A Flower message's object tree, read from its wire form (the ``ObjectTree`` protobuf message).

Flower sends a message as a tree of content-addressed objects (the message, its records, each
array's chunks); the receiver pulls every object of the tree. Both the coordinator's and the
site's pulls (:mod:`.transfer`) and the SuperLink's reply limits (:mod:`.upload_limits`) list a
tree's object ids. The tree's fields (``object_id``, ``children``) are Flower's wire protocol,
read here instead of through Flower's internal helpers; ``tests/federation/test_records.py``
checks the order against the installed Flower's own walk.
"""

from __future__ import annotations

from typing import Any


def object_ids(tree: Any) -> list[str]:
    """Every object id of ``tree``, each object's children before the object itself (the root last).

    Iterative, so a hostile, deeply nested tree costs memory in proportion to its size and never
    exhausts the interpreter's stack.
    """
    out: list[str] = []
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.append(node.object_id)
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(node.children))
    return out
