"""Views: PySide6 widgets that emit intents and expose ``set_*`` methods (see :mod:`.bases`)."""
