"""pagelm: a runtime for small language models whose weights stay in the model file."""

__version__ = "0.1.0"
