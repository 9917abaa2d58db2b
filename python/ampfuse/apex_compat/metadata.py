"""Installs ampfuse's apex alias into an environment as a package named apex.

Some libraries decide whether apex is there before they import it: transformers'
is_apex_available() asks importlib.util.find_spec("apex"), others ask the package metadata
(importlib.metadata.version("apex"), pkg_resources). Worker processes started by a launcher
never run the caller's install_apex_alias(). For those, `python -m ampfuse.apex_compat install`
writes two things into site-packages:

* ``apex/__init__.py``: a stub whose first line is STUB_MARKER and which only calls
  install_apex_alias(), so nothing runs until something imports apex;
* ``apex-0.0.0+ampfuse.dist-info``: metadata of a distribution named apex at version
  0.0.0+ampfuse, installer "ampfuse", with a RECORD, so that `pip uninstall apex` removes it as
  well as `python -m ampfuse.apex_compat uninstall` does, and so that installing the real apex
  with pip replaces it.

It refuses to install while another apex is installed, and uninstall removes only what it wrote.
No .pth file and no environment variable is involved: nothing changes for a process that does
not import apex.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import pathlib
import shutil
import sys
import sysconfig

from ampfuse.apex_compat import ALIAS_VERSION, STUB_MARKER, ApexAliasError, real_apex

INSTALLER = "ampfuse"
DIST_INFO = f"apex-{ALIAS_VERSION}.dist-info"

_STUB = f'''{STUB_MARKER}
"""Written by `python -m ampfuse.apex_compat install`: `import apex` gives ampfuse's apex
compatibility alias (ampfuse.apex_compat). Remove it with `python -m ampfuse.apex_compat
uninstall` or `pip uninstall apex`."""

from ampfuse.apex_compat import install_apex_alias

install_apex_alias()
'''

_METADATA = f"""Metadata-Version: 2.1
Name: apex
Version: {ALIAS_VERSION}
Summary: ampfuse's apex compatibility alias (not NVIDIA apex): import apex runs on ampfuse
Requires-Dist: ampfuse
"""


def default_site() -> pathlib.Path:
    """site-packages of the running interpreter (of the active virtual environment)."""
    return pathlib.Path(sysconfig.get_paths()["purelib"])


def _record_line(root: pathlib.Path, path: pathlib.Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path.relative_to(root).as_posix()},sha256={digest},{len(data)}"


def _ours(dist_info: pathlib.Path) -> bool:
    installer = dist_info / "INSTALLER"
    return installer.is_file() and installer.read_text().strip() == INSTALLER


def _stub_is_ours(package: pathlib.Path) -> bool:
    init = package / "__init__.py"
    if not init.is_file():
        return False
    with init.open(encoding="utf-8") as stub:
        return stub.readline().rstrip("\n") == STUB_MARKER


def _foreign_apex(site: pathlib.Path):
    """Describes an apex installed here or anywhere on sys.path that is not ours, or None."""
    package = site / "apex"
    if package.exists() and not _stub_is_ours(package):
        return str(package)
    for paths in ([str(site)], sys.path):  # `site` itself, then where this Python looks
        for dist in importlib.metadata.distributions(name="apex", path=paths):
            if (dist.read_text("INSTALLER") or "").strip() != INSTALLER:
                return f"apex {dist.version}, metadata in {dist.locate_file('')}"
    return real_apex()


def install(site: pathlib.Path | None = None) -> pathlib.Path:
    """Writes the stub package and its metadata into `site` (default: this environment's
    site-packages); returns the dist-info directory. Installing twice rewrites the same files."""
    site = pathlib.Path(site) if site is not None else default_site()
    foreign = _foreign_apex(site)
    if foreign is not None:
        raise ApexAliasError(
            f"apex-alias install: another apex is installed ({foreign}); ampfuse will not hide "
            "it. Uninstall it first (pip uninstall apex), or keep it and do not use the alias.")
    for stale in site.glob("apex-*.dist-info"):
        if _ours(stale):
            shutil.rmtree(stale)
    package = site / "apex"
    dist_info = site / DIST_INFO
    package.mkdir(parents=True, exist_ok=True)
    dist_info.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(_STUB, encoding="utf-8")
    (dist_info / "METADATA").write_text(_METADATA, encoding="utf-8")
    (dist_info / "INSTALLER").write_text(INSTALLER + "\n", encoding="utf-8")
    (dist_info / "top_level.txt").write_text("apex\n", encoding="utf-8")
    files = [package / "__init__.py"] + [dist_info / n for n in ("METADATA", "INSTALLER",
                                                                  "top_level.txt")]
    record = [_record_line(site, f) for f in files] + [f"{DIST_INFO}/RECORD,,"]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n", encoding="utf-8")
    importlib.invalidate_caches()
    return dist_info


def uninstall(site: pathlib.Path | None = None) -> bool:
    """Removes what install() wrote from `site`; returns False when it was not installed there.
    A real apex in the same place is left alone."""
    site = pathlib.Path(site) if site is not None else default_site()
    removed = False
    for dist_info in site.glob("apex-*.dist-info"):
        if _ours(dist_info):
            shutil.rmtree(dist_info)
            removed = True
    package = site / "apex"
    if _stub_is_ours(package):
        shutil.rmtree(package)
        removed = True
    importlib.invalidate_caches()
    return removed


def status(site: pathlib.Path | None = None) -> str:
    """One line saying what `import apex` would find in `site`."""
    site = pathlib.Path(site) if site is not None else default_site()
    if (site / DIST_INFO).is_dir() and _stub_is_ours(site / "apex"):
        return f"installed: ampfuse's apex alias ({ALIAS_VERSION}) in {site}"
    foreign = _foreign_apex(site)
    if foreign is not None:
        return f"not installed: another apex is installed ({foreign})"
    return f"not installed in {site}"
