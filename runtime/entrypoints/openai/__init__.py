"""The OpenAI-compatible HTTP server: ``api_server`` (app, probes, thin routes), the serving
modules per endpoint, the wire-format models (``protocol``) and ``kvfleet serve`` options.
"""
