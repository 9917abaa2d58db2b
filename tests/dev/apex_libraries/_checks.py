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


# Group keys that the apex alias's optimizers carry for apex's sake, with the value that means
# "off": the alias FusedAdam keeps apex 0.1's per-group max_grad_norm (0: no clipping), which
# ampfuse's own FusedAdam has no use for. Left out where off, an alias optimizer's groups
# compare equal with those of ampfuse's own optimizer built with the same arguments.
ALIAS_ONLY_GROUP_KEYS = {"max_grad_norm": 0.0}


def hyperparameters(optimizer):
    """Each param group's settings (all but its params and alias-only keys that are off), in
    group order."""
    def kept(key, value):
        return key != "params" and not (key in ALIAS_ONLY_GROUP_KEYS
                                         and value == ALIAS_ONLY_GROUP_KEYS[key])

    return [{k: v for k, v in group.items() if kept(k, v)} for group in optimizer.param_groups]
