"""Every rule a recipe must satisfy, checked before any process group exists (docs/config.md).

`registry.py` lists the rule modules in the order their rules run (and messages list
violations); `base.py` is what a rule is. A rule module holds the rules of one concern.
"""
