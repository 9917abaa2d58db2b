"""The training frameworks are optional: `import ampfuse` never imports them, and an integration
whose framework is missing raises an ImportError that names the extra to install."""

import subprocess
import sys
import textwrap

FRAMEWORKS = {
    "ampfuse.integrations.lightning": "lightning",
    "ampfuse.integrations.accelerate": "accelerate",
    "ampfuse.integrations.transformers": "transformers",
}


def test_frameworks_are_imported_lazily_and_their_absence_is_explained():
    # A fresh interpreter: this one may already hold the frameworks from other tests.
    script = textwrap.dedent(
        f"""
        import importlib, sys
        import ampfuse, ampfuse.integrations
        frameworks = {FRAMEWORKS!r}
        loaded = sorted(set(frameworks.values()) & set(sys.modules))
        assert not loaded, f"import ampfuse imported {{loaded}}"
        for name in frameworks.values():
            sys.modules[name] = None  # what an environment without it looks like to import
        for module, framework in frameworks.items():
            try:
                importlib.import_module(module)
            except ImportError as error:
                message = str(error)
                assert 'pip install "ampfuse[integrations]"' in message, message
                assert f"`{{framework}}` package" in message, message
            else:
                raise AssertionError(f"{{module}} imported without {{framework}}")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
