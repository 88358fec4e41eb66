"""The desktop app's shipped demo (package data only, no code).

``demo.json`` (manifest: settings, file names, SHA-256, validation Dice, how the demo photo is
routed), the demo super model ``demo_fundus.safetensors`` (float16 weights), the demo photo and
its ground-truth mask. Written by ``python benchmarks/build_demo_bundle.py``
(:func:`engine.demo.build_shipped_demo`); read by :func:`engine.demo.shipped_demo`.
"""
