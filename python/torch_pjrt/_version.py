__version__ = "0.1.0"  # the one place: pyproject.toml reads it
