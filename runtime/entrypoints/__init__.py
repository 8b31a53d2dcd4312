"""Server entry points (HTTP APIs) over the engine client protocol."""
