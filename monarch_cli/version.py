"""The package's version, in a leaf module: the runtime reads it without importing the package root."""

__version__ = "0.1.0"
