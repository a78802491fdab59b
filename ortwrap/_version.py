"""ortwrap's version: the one place it is written (pyproject.toml reads it, ``ortwrap.__version__`` is it)."""

__version__ = "0.1.0"
