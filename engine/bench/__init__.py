"""``fedsm bench``: reproduce the FedSM paper's comparisons on synthetic multi-site data.

Modules: :mod:`~engine.bench.presets` (what a run covers), :mod:`~engine.bench.cache` (one JSON
file per finished job, so an interrupted run resumes), :mod:`~engine.bench.jobs` (train and
evaluate one method / analysis), :mod:`~engine.bench.runner` (the whole run),
:mod:`~engine.bench.tables`, :mod:`~engine.bench.plots` and :mod:`~engine.bench.results_md`
(reports), :mod:`~engine.bench.perf` (speed, traffic and memory ratios).
"""
