"""Qt-free state of the app and pure numpy rendering (importable without PySide6)."""
