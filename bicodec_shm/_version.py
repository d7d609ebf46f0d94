"""The package version, importable by every layer without importing the package's public surface."""

__version__ = "0.1.0"
