"""``kvfleet router``: the fleet's request path (an OpenAI-aware proxy in front of runtime replicas).

A pure proxy: it never imports the engine, the worker or torch (tests/repo/test_layering.py checks it
loads without them). How it routes and its knobs: docs/routing.md.
"""
