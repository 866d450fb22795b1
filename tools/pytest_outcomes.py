"""A pytest plugin for tools/gpu_check.py: ``pytest -p pytest_outcomes --outcomes FILE`` appends
each test's outcome to FILE as one JSON line as soon as it is known (and each collection error),
so a run that its time budget kills still says which tests finished and how. JUnit XML, by
contrast, is written only when the session ends.

Lines: {"nodeid", "outcome": "passed" | "failed" | "skipped" | "error", "when", "message"}.
"""
from __future__ import annotations

import json


def pytest_addoption(parser):
    parser.addoption("--outcomes", default=None, help="append one JSON line per test outcome to this file")


def pytest_configure(config):
    path = config.getoption("outcomes")
    if path:
        config.pluginmanager.register(OutcomeWriter(path), "gpu-check-outcomes")


class OutcomeWriter:
    def __init__(self, path: str):
        self.path = path

    def _write(self, nodeid: str, outcome: str, when: str, message: str | None) -> None:
        with open(self.path, "a") as f:     # opened per line: a kill never loses a buffered one
            f.write(json.dumps({"nodeid": nodeid, "outcome": outcome, "when": when, "message": message}) + "\n")

    def pytest_runtest_logreport(self, report):
        # a test yields setup, call and teardown reports: its outcome is the call's, unless setup
        # skipped it (a skip mark) or setup/teardown failed (an error, as pytest counts it)
        if report.when == "call":
            outcome = report.outcome
        elif report.failed:
            outcome = "error"
        elif report.skipped:
            outcome = "skipped"
        else:
            return
        self._write(report.nodeid, outcome, report.when, _message(report) if outcome != "passed" else None)

    def pytest_collectreport(self, report):
        if report.failed:
            self._write(report.nodeid, "error", "collect", _message(report))


def _message(report) -> str:
    """A skip's reason, or a failure's exception (its message; else the report's last line)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")[:300]
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message[:300]
    lines = report.longreprtext.strip().splitlines()
    return lines[-1][:300] if lines else ""
