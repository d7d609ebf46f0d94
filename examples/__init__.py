"""Examples that run from the repository root (not installed with the package)."""
