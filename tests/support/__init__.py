"""Helpers shared by the test modules (``tests/`` is on ``sys.path`` through ``tests/conftest.py``,
so they are imported as ``support.<module>``): see tests/README.md for what each module holds.
A test module never imports another test module: what two of them share lives here."""
