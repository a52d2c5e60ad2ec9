"""The shipped configs, as package data laid out like a user config dir.

`conf/` (config groups) and `recipes/` stay at the repository's top level; the entries here
are symlinks to `recipes/` and to each group folder of `conf/`, so a source checkout, an
editable install and a built wheel (where setuptools copies the files they point to) all
reach the same files through this package: `pkg://megatron_bridge._bundled` on Hydra's
search path, never by walking up from the source tree. A new group folder in `conf/` needs
its symlink here (tests/unit/config/test_config_dirs.py checks). See megatron_bridge/config/search.py.
"""
