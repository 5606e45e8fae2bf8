"""Helpers for tests/test_examples.py: a callback that reports what every rank trained."""
