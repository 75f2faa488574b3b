"""The registry and retention CLI: ``python -m tasks.registry list|promote|rollback|retention`` (see __main__)."""
