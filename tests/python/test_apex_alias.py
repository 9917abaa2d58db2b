"""The apex alias: `import apex` resolving to ampfuse, opt-in and never over a real apex.

Two switches are tested: install_apex_alias() in this process, and the installed stub package
with apex's distribution metadata (`python -m ampfuse.apex_compat install`), which libraries
that look for apex before importing it need (transformers 4.x asks importlib.util.find_spec
and importlib.metadata.version). The library runs themselves are dev checks in
tests/dev/apex_libraries.
"""

import base64
import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
import types

import pytest

import ampfuse
from ampfuse.apex_compat import (
    ALIAS_VERSION,
    ApexAliasError,
    apex_alias_installed,
    install_apex_alias,
    real_apex,
    uninstall_apex_alias,
)
from ampfuse.apex_compat import metadata
from ampfuse.apex_compat.__main__ import main as cli_main


def _apex_modules():
    return {n: m for n, m in sys.modules.items() if n == "apex" or n.startswith("apex.")}


@pytest.fixture
def no_apex():
    """A process with no apex imported and no alias; restored afterwards."""
    saved_modules, saved_meta_path = _apex_modules(), list(sys.meta_path)
    for name in saved_modules:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in saved_meta_path if type(f).__name__ != "_MissingApexModules"]
    importlib.invalidate_caches()
    if real_apex() is not None:
        pytest.skip(f"a real apex is installed here ({real_apex()})")
    yield
    for name in _apex_modules():
        del sys.modules[name]
    sys.modules.update(saved_modules)
    sys.meta_path[:] = saved_meta_path
    importlib.invalidate_caches()


def _fake_apex(root, body="raise AssertionError('the real apex must not be imported')\n"):
    package = root / "apex"
    package.mkdir()
    (package / "__init__.py").write_text(body)
    return package


# ---- install_apex_alias in this process ----------------------------------------------------------


def test_every_apex_import_form_resolves_to_ampfuse(no_apex):
    returned = install_apex_alias()
    import apex
    import apex.optimizers
    from apex import amp
    from apex.normalization.fused_layer_norm import FusedLayerNorm, fused_layer_norm_affine
    from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model
    from apex.amp._amp_state import _amp_state
    from apex.parallel.LARC import LARC

    assert apex is returned and apex_alias_installed()
    assert amp is ampfuse.amp and apex.amp is ampfuse.amp
    assert importlib.import_module("apex.amp") is ampfuse.amp
    assert _amp_state is ampfuse.amp._amp_state  # the module apex scripts read it from
    assert issubclass(apex.optimizers.FusedAdam, ampfuse.optimizers.FusedAdam)
    assert issubclass(apex.optimizers.FusedSGD, ampfuse.optimizers.FusedSGD)
    assert apex.__version__ == ALIAS_VERSION
    assert callable(fused_layer_norm_affine) and callable(convert_syncbn_model)
    assert FusedLayerNorm and DistributedDataParallel and SyncBatchNorm and LARC
    # transformers 5's is_apex_available() and timm/mmengine's try-imports look no further.
    assert importlib.util.find_spec("apex") is not None


def test_apex_optimizer_submodules_resolve_to_the_alias(no_apex):
    """fairseq's and DeepSpeed's old apex paths import from apex's submodules."""
    install_apex_alias()
    from apex.optimizers.fused_adagrad import FusedAdagrad
    from apex.optimizers.fused_adam import FusedAdam
    from apex.optimizers.fused_lamb import FusedLAMB
    from apex.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb
    from apex.optimizers.fused_novograd import FusedNovoGrad
    from apex.optimizers.fused_sgd import FusedSGD

    import apex.optimizers
    for cls in (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad,
                FusedSGD):
        assert getattr(apex.optimizers, cls.__name__) is cls
    assert uninstall_apex_alias() is True
    assert "apex.optimizers.fused_adam" not in sys.modules


def test_the_imports_of_apexs_imagenet_example_succeed(no_apex):
    install_apex_alias()
    try:
        namespace = {}
        exec("import torch\n"
             "from apex.parallel import DistributedDataParallel as DDP\n"
             "from apex.fp16_utils import *\n"
             "from apex import amp, optimizers\n"
             "from apex.multi_tensor_apply import multi_tensor_applier\n"
             "from apex.fp16_utils.fp16_optimizer import FP16_Optimizer\n", namespace)
        assert namespace["to_python_float"](namespace["torch"].tensor([2.5])) == 2.5
        assert namespace["FP16_Optimizer"].__name__ == "FP16_Optimizer"
        assert namespace["multi_tensor_applier"].available is False
    finally:
        uninstall_apex_alias()


def test_install_is_idempotent(no_apex):
    first = install_apex_alias()
    meta_path = list(sys.meta_path)
    assert install_apex_alias() is first
    assert sys.meta_path == meta_path


def test_uninstall_restores_the_process(no_apex):
    meta_path = list(sys.meta_path)
    install_apex_alias()
    assert uninstall_apex_alias() is True
    assert not _apex_modules() and sys.meta_path == meta_path
    with pytest.raises(ModuleNotFoundError):
        import apex  # noqa: F401
    assert uninstall_apex_alias() is False


def test_missing_apex_modules_name_the_replacement(no_apex):
    install_apex_alias()
    with pytest.raises(ModuleNotFoundError, match=r"apex\.mlp.*Sequential of Linear") as info:
        import apex.mlp  # noqa: F401
    assert info.value.name == "apex.mlp"
    with pytest.raises(ModuleNotFoundError, match="apex.contrib"):
        from apex.contrib.sparsity import ASP  # noqa: F401
    # Libraries that probe with try/except ImportError still fall back.
    try:
        from apex.transformer import parallel_state  # noqa: F401
        probed = True
    except ImportError:
        probed = False
    assert not probed
    # Under the alias's module-file packages too, not Python's "is not a package".
    for name in ("apex.optimizers.fused_foo", "apex.fp16_utils.foo",
                 "apex.multi_tensor_apply.foo", "apex.contrib.optimizers.foo"):
        with pytest.raises(ModuleNotFoundError, match="compatibility alias") as info:
            importlib.import_module(name)
        assert info.value.name == name
    with pytest.raises(ModuleNotFoundError, match="torchrun"):
        import apex.parallel.multiproc  # noqa: F401


def test_apex_parallel_submodules_resolve_to_the_alias(no_apex):
    """NVIDIA's BERT scripts import flat_dist_call from apex.parallel.distributed; others take
    SyncBatchNorm from where apex defined it."""
    install_apex_alias()
    from apex.parallel import Reducer
    from apex.parallel.distributed import DistributedDataParallel, flat_dist_call
    from apex.parallel.optimized_sync_batchnorm import SyncBatchNorm as Optimized
    from apex.parallel.sync_batchnorm import SyncBatchNorm

    import apex.parallel
    assert DistributedDataParallel is apex.parallel.DistributedDataParallel
    assert SyncBatchNorm is Optimized is apex.parallel.SyncBatchNorm
    assert callable(flat_dist_call) and Reducer is apex.parallel.distributed.Reducer
    assert uninstall_apex_alias() is True
    assert "apex.parallel.distributed" not in sys.modules


def test_refuses_a_real_apex_on_the_path_and_changes_nothing(no_apex, tmp_path, monkeypatch):
    package = _fake_apex(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    meta_path = list(sys.meta_path)
    with pytest.raises(ApexAliasError, match="replace_real_apex=True") as info:
        install_apex_alias()
    assert str(package / "__init__.py") in str(info.value)
    assert not _apex_modules() and sys.meta_path == meta_path
    # Asked for explicitly, the alias wins in this process; the real package is not imported.
    apex = install_apex_alias(replace_real_apex=True)
    assert apex.amp is ampfuse.amp and apex_alias_installed()


def test_refuses_a_real_apex_already_imported_even_when_told_to_replace(no_apex):
    real = types.ModuleType("apex")
    real.__file__ = "/opt/site-packages/apex/__init__.py"
    sys.modules["apex"] = real
    for replace in (False, True):
        with pytest.raises(ApexAliasError, match="already imported"):
            install_apex_alias(replace_real_apex=replace)
        assert sys.modules["apex"] is real


def test_refuses_a_directory_named_apex(no_apex, tmp_path, monkeypatch):
    (tmp_path / "apex").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(ApexAliasError, match="without __init__.py"):
        install_apex_alias()


# ---- the installed stub and apex's metadata ------------------------------------------------------


def _record_ok(site):
    dist_info = site / metadata.DIST_INFO
    for line in (dist_info / "RECORD").read_text().splitlines():
        path, digest, size = line.split(",")
        if not digest:
            continue
        data = (site / path).read_bytes()
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        assert digest == "sha256=" + expected.decode() and int(size) == len(data), path
    return True


def test_installed_alias_satisfies_metadata_checks_and_imports(no_apex, tmp_path, monkeypatch):
    site = tmp_path / "site"
    metadata.install(site)
    assert _record_ok(site)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    # What transformers 4.x's _is_package_available("apex") asks, without importing apex.
    assert importlib.util.find_spec("apex").origin == str(site / "apex" / "__init__.py")
    assert importlib.metadata.version("apex") == ALIAS_VERSION
    assert real_apex() is None  # the stub is ours, not a real apex
    import apex

    assert apex_alias_installed() and apex.amp is ampfuse.amp
    assert "installed" in metadata.status(site)


def test_install_refuses_a_foreign_apex_and_writes_nothing(no_apex, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _fake_apex(site)
    with pytest.raises(ApexAliasError, match="pip uninstall apex"):
        metadata.install(site)
    assert not (site / metadata.DIST_INFO).exists()
    assert "raise AssertionError" in (site / "apex" / "__init__.py").read_text()
    # A foreign distribution named apex (for instance apex from PyPI, an unrelated package).
    other = tmp_path / "other"
    dist_info = other / "apex-0.9.10.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: apex\nVersion: 0.9.10\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    with pytest.raises(ApexAliasError, match="apex 0.9.10"):
        metadata.install(other)
    assert not (other / "apex").exists()


def test_uninstall_removes_only_what_install_wrote(no_apex, tmp_path):
    site = tmp_path / "site"
    assert metadata.uninstall(site) is False
    metadata.install(site)
    metadata.install(site)  # a second install rewrites the same files
    (site / "unrelated.py").write_text("x = 1\n")
    assert metadata.uninstall(site) is True
    assert sorted(p.name for p in site.iterdir()) == ["unrelated.py"]
    _fake_apex(site)
    assert metadata.uninstall(site) is False
    assert (site / "apex" / "__init__.py").exists()


def test_command_line(no_apex, tmp_path, capsys):
    site = tmp_path / "site"
    assert cli_main(["install", "--site", str(site)]) == 0
    assert "installed ampfuse's apex alias" in capsys.readouterr().out
    assert cli_main(["status", "--site", str(site)]) == 0
    assert "installed: ampfuse's apex alias" in capsys.readouterr().out
    assert cli_main(["uninstall", "--site", str(site)]) == 0
    _fake_apex(site)
    assert cli_main(["install", "--site", str(site)]) == 1
    assert "error: apex-alias install: another apex is installed" in capsys.readouterr().err



def test_the_ampfuse_cli_has_the_apex_alias_command(tmp_path, capsys):
    from ampfuse.tools.cli import main

    assert main(["apex-alias", "status", "--site", str(tmp_path)]) == 0
    assert "not installed" in capsys.readouterr().out
    assert main(["apex-alias", "install", "--site", str(tmp_path)]) == 0
    assert (tmp_path / "apex").is_dir()
    assert main(["apex-alias", "uninstall", "--site", str(tmp_path)]) == 0
    assert not (tmp_path / "apex").exists()
