"""Controllers: the only code that connects state, views and ``engine.api`` (Qt-free)."""
