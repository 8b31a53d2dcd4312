"""Grammar-constrained decoding (structured outputs) through xgrammar: see :mod:`.manager`."""
