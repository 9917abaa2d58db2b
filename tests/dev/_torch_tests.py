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
