"""pyproject's filterwarnings: our own deprecations fail the suite, named third-party noise
stays quiet, and the ignore rules are anchored so they cannot swallow megatron_bridge's."""

import warnings

import pytest


def _warn(category: type[Warning], message: str, module: str) -> None:
    # warn_explicit attributes the warning to `module`, as a warnings.warn inside it would.
    warnings.warn_explicit(message, category, filename=f"{module.replace('.', '/')}.py", lineno=1, module=module)


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning, UserWarning])
def test_our_own_warnings_are_errors(category):
    with pytest.raises(category):
        _warn(category, "old_option is deprecated", "megatron_bridge.config.compose")


def test_megatron_ignore_rule_does_not_cover_megatron_bridge():
    # the same text megatron-core's rule ignores, raised from our package, still fails
    with pytest.raises(UserWarning):
        _warn(UserWarning, "Transformer Engine and Apex are not installed.", "megatron_bridge.train.engines")


def test_named_third_party_warning_is_ignored_and_others_are_shown():
    with warnings.catch_warnings(record=True) as seen:
        _warn(UserWarning, "Transformer Engine and Apex are not installed.", "megatron.core.optimizer")
        _warn(UserWarning, "something new", "megatron.core.optimizer")
    assert [str(w.message) for w in seen] == ["something new"]
