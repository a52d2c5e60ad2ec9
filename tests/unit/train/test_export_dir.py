"""What a resumed run may find in its `export_to` (train/runner.py `interval_exports`): only
its own interval exports, published or left unpublished by a stopped run."""

from megatron_bridge.train.runner import interval_exports


def test_only_interval_exports_may_be_resumed_into(tmp_path):
    d = tmp_path / "exports"
    (d / "iter_0000002").mkdir(parents=True)
    (d / "iter_0000004.tmp").mkdir()
    assert interval_exports(d)
    (d / "config.json").write_text("{}")  # an end-of-run export, or anything of the user's
    assert not interval_exports(d)
    (d / "config.json").unlink()
    (d / "iter_12").mkdir()  # not our name
    assert not interval_exports(d)
    (d / "iter_12").rmdir()
    (d / "iter_0000006").write_text("")  # a file, not a directory
    assert not interval_exports(d)
