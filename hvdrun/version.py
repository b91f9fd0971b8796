"""hvdrun's version (a module of its own: the CLI reads it without the package's API)."""

__version__ = "0.1.0"
