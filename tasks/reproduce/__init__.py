"""Rerun a committed stage from its manifest alone (tasks/reproduce/rerun.py), from the CLI in __main__.py."""
