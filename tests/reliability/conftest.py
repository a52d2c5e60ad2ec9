"""Print the reliability figures at the end of a pytest run: the bad-input catalogue's table
and the crash/resume/hang scenarios (collected by the tests' fixtures on `config`)."""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = getattr(config, "_mbr_catalogue", None)
    if results:
        try:
            from catalogue import table
        except ImportError:  # pragma: no cover
            from tests.reliability.catalogue import table
        terminalreporter.write_sep("=", "bad-input catalogue")
        terminalreporter.write_line(table(results))
    crash = getattr(config, "_mbr_crash", None)
    if crash:
        try:
            from test_crash_resume import figures
        except ImportError:  # pragma: no cover
            from tests.reliability.test_crash_resume import figures
        terminalreporter.write_sep("=", "crash, resume and hang scenarios")
        terminalreporter.write_line(figures(*crash))
