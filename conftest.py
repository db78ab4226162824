"""Session-wide test settings for the whole course (unit tests, browser test, notebooks)."""
import collections


def pytest_terminal_summary(terminalreporter):
    """List the skipped tests' reasons with a count each, so that "175  no working CUDA GPU
    here" stands out instead of one line per test."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skipped tests, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.line(f"{count:5d}  {reason}")
