"""What every check script here prints: one line per check, then a summary and an exit code."""


class Checks:
    def __init__(self, subject):
        self.subject = subject
        self.failures = []

    def __call__(self, condition, what):
        print(("ok    " if condition else "FAIL  ") + what, flush=True)
        if not condition:
            self.failures.append(what)

    def finish(self) -> int:
        """Prints the summary; returns the exit code (1 when any check failed)."""
        if self.failures:
            print(f"{len(self.failures)} {self.subject} checks failed")
            return 1
        print(f"all {self.subject} checks passed")
        return 0
