"""Qt runners for long work (thread pool) and for the site process (QProcess)."""
