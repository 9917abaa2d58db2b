"""What the dev suites that run PyTorch's own tests against ampfuse share: finding the test file
in a PyTorch checkout, and running a unittest suite into one outcome per test."""

from __future__ import annotations

import argparse
import io
import sys
import unittest
from pathlib import Path


def parse_suite_args(description: str, test_file: str) -> tuple[argparse.Namespace, Path]:
    """The suites' command line: a PyTorch checkout (or the file itself), -k and -v. Returns
    the arguments and the path of test/<test_file>."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("pytorch_src", type=Path,
                        help=f"a PyTorch checkout (or the path of its test/{test_file})")
    parser.add_argument("-k", dest="name_filter", help="only tests whose name contains this")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print unittest's output for ampfuse's run, tracebacks included")
    args = parser.parse_args()
    path = args.pytorch_src / "test" / test_file
    if not path.is_file():
        path = args.pytorch_src
    if not path.is_file():
        raise SystemExit(f"no test/{test_file} under {args.pytorch_src}")
    return args, path


def run_suite(suite: unittest.TestSuite, verbose: bool) -> dict[str, tuple[str, str]]:
    """Runs `suite`; returns test name -> (outcome: ok / FAIL / ERROR / skip / xfail, the last
    line of its traceback or skip reason)."""
    # Named before the run: a suite lets go of its tests as it runs them.
    outcomes = {test._testMethodName: ("ok", "") for test in suite}
    stream = sys.stdout if verbose else io.StringIO()
    result = unittest.TextTestRunner(stream=stream, verbosity=2).run(suite)
    for label, entries in (("FAIL", result.failures), ("ERROR", result.errors),
                           ("skip", result.skipped), ("xfail", result.expectedFailures)):
        for test, detail in entries:
            last = detail.strip().splitlines()[-1] if detail.strip() else ""
            outcomes[test._testMethodName] = (label, last)
    return outcomes


def report(baseline: dict, ours: dict, expected: dict[str, str] | None = None,
           width: int = 82) -> int:
    """Prints one line per test with its outcome under torch's class and under ampfuse's, the
    counts, the tests that differ on purpose (`expected`: test name -> reason) and those that
    pass only with torch's. Returns the exit status: 1 when any of the last exist."""
    expected = expected or {}
    unexpected, on_purpose = [], []
    print(f"{'test (CPU)':<{width}} {'torch':>6} {'ampfuse':>8}")
    for name in sorted(set(baseline) | set(ours)):
        theirs, (mine, detail) = baseline.get(name, ("-", ""))[0], ours.get(name, ("-", ""))
        print(f"{name:<{width}} {theirs:>6} {mine:>8}")
        if theirs == "ok" and mine != "ok":
            if name in expected:
                on_purpose.append((name, expected[name]))
            else:
                unexpected.append((name, detail))
    for label, results in (("torch's", baseline), ("ampfuse's", ours)):
        counts = {}
        for outcome, _ in results.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"with {label}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if on_purpose:
        print(f"\nDiffer on purpose: {len(on_purpose)}")
        for name, reason in on_purpose:
            print(f"  {name}: {reason}")
    if unexpected:
        print(f"\nPass with torch's class but not with ampfuse's: {len(unexpected)}")
        for name, detail in unexpected:
            print(f"  {name}: {detail[:150]}")
    return 1 if unexpected else 0
