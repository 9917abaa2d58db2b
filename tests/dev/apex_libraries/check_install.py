"""Dev check: the installed apex alias behaves as a package under pip, in a scratch environment.

In a new virtual environment (made with ``--system-site-packages`` so that the base
interpreter's pip runs in it; nothing is downloaded), this script:

1. installs the alias with ``python -m ampfuse.apex_compat install --site <its site-packages>``
   and checks that ``pip show apex`` lists it at version 0.0.0+ampfuse;
2. installs a wheel of another distribution named apex (built here, standing in for the real
   apex) with pip, and checks that pip first uninstalls the alias (same distribution name), so
   a real apex always replaces it cleanly;
3. checks that ``install`` now refuses and leaves that apex alone;
4. uninstalls it, installs the alias again, and checks that ``pip uninstall -y apex`` removes
   every file the alias wrote.

Run it from the repository root (about 30 s)::

    python tests/dev/apex_libraries/check_install.py
"""

from __future__ import annotations

import base64
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from _checks import Checks
from ampfuse.apex_compat import ALIAS_VERSION, metadata

check = Checks("install")


def run(*args, **kwargs):
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONPATH": ""}
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env,
                          **kwargs)


def other_apex_wheel(directory: pathlib.Path) -> pathlib.Path:
    """A minimal wheel of a distribution named apex, version 1.0 (not ampfuse's)."""
    files = {
        "apex/__init__.py": b"OTHER_APEX = True\n",
        "apex-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: apex\nVersion: 1.0\n",
        "apex-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: check_install\n"
                                    b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("apex-1.0.dist-info/RECORD,,")
    wheel = directory / "apex-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("apex-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


def main():
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        env = scratch / "env"
        made = run(sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", env)
        check(made.returncode == 0, "made a scratch environment")
        python = env / "bin" / "python"
        if run(python, "-m", "pip", "--version").returncode:
            print("the base interpreter has no pip; nothing more to check")
            return 1
        site = pathlib.Path(run(python, "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])").stdout.strip())
        cli = [sys.executable, "-m", "ampfuse.apex_compat"]

        check(run(*cli, "install", "--site", site).returncode == 0, "alias installed")
        shown = run(python, "-m", "pip", "show", "apex").stdout
        check(f"Version: {ALIAS_VERSION}" in shown, f"pip show apex: version {ALIAS_VERSION}")

        replaced = run(python, "-m", "pip", "install", "--no-index", "--no-deps",
                       other_apex_wheel(scratch))
        check(replaced.returncode == 0 and "Successfully uninstalled apex-0.0.0+ampfuse"
              in replaced.stdout, "pip install of another apex uninstalls the alias first")
        check(not (site / metadata.DIST_INFO).exists()
              and "OTHER_APEX" in (site / "apex" / "__init__.py").read_text(),
              "only the other apex is left")

        refused = run(*cli, "install", "--site", site)
        check(refused.returncode == 1 and "another apex is installed" in refused.stderr,
              "install refuses while the other apex is there")
        check("OTHER_APEX" in (site / "apex" / "__init__.py").read_text(),
              "the other apex is untouched")

        run(python, "-m", "pip", "uninstall", "-y", "apex")
        check(run(*cli, "install", "--site", site).returncode == 0, "alias installed again")
        removed = run(python, "-m", "pip", "uninstall", "-y", "apex")
        check(removed.returncode == 0 and not (site / "apex").exists()
              and not (site / metadata.DIST_INFO).exists(),
              "pip uninstall apex removes every file of the alias")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
