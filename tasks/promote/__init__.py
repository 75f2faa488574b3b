"""Promotion stage: the gate between an evaluated candidate and the model's champion.

    python -m tasks.promote --evaluation <eval URI> --registry s3://bucket/prefix/models/<name> \
        --gate '{"accuracy": {"max_drop": 0.02}, ...}' --allow_promotion true --output <URI>

Judges the candidate against the champion the eval stage compared it with (the SFT baseline when there
was none), records the verdict under the registry's candidates/, and promotes by compare-and-swap on
champion.json. A rejected candidate is kept and reported, never promoted; the stage succeeds either way
and its manifest says ``promoted`` true or false.
"""
