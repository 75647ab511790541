"""The package version, in the lowest layer so that every module (the CLI included) can read it."""

__all__ = ["VERSION"]

VERSION = "0.1.0"  # setup.py reads it from here
