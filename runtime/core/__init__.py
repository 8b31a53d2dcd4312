"""Torch-free engine core: requests, the KV block pool and cache manager, and the scheduler.

Nothing here imports torch (tests/repo/test_layering.py checks it in a fresh interpreter).
"""
