"""Site datasets, preprocessing and the synthetic multi-site generator."""
