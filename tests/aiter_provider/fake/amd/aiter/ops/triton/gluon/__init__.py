"""Fake aiter subpackage."""
