"""ampfuse.fp8.convert and amp.initialize's fp8_* options: which Linears go FP8, in what
order the rules decide, what is refused, and what verbosity=1 prints."""

import pytest
import torch
from ampfuse import amp, fp8
from ampfuse.fp8.convert import AUTO_MIN_FEATURES
from helpers import raises_naming


class Block(torch.nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.up = torch.nn.Linear(hidden, ffn)
        self.down = torch.nn.Linear(ffn, hidden)
        self.odd = torch.nn.Linear(hidden, 10)


class Subclassed(torch.nn.Linear):
    pass


def gpt2_sized():
    return Block(768, 3072)


def is_fp8(model, name):
    return isinstance(model.get_submodule(name), fp8.Linear)


def test_automatic_rule_keeps_gpt2_small_and_converts_large_layers():
    small = gpt2_sized()
    decisions = fp8.convert(small)
    assert not fp8.fp8_modules(small)
    assert decisions["up"].startswith("kept: 768 -> 3072: GEMM too small")
    assert "not a multiple of 16" in decisions["odd"]
    big = torch.nn.Sequential(torch.nn.Linear(AUTO_MIN_FEATURES, 2 * AUTO_MIN_FEATURES,
                                              device="meta"))
    assert fp8.convert(big)["0"].startswith("fp8:") and is_fp8(big, "0")


def test_precedence_exclude_include_filter_min_features():
    model = Block(64, 128)
    decisions = fp8.convert(model, min_features=100, include=["up"], exclude=["up"])
    assert decisions["up"] == "kept: in exclude"
    model = Block(64, 128)
    decisions = fp8.convert(model, min_features=100, include=["down"])
    assert decisions["down"] == "fp8: in include" and is_fp8(model, "down")
    assert decisions["up"].startswith("kept: 64 -> 128") and "min_features" in decisions["up"]
    model = Block(64, 128)
    seen = []
    decisions = fp8.convert(model, module_filter=lambda fqn, m: seen.append(fqn) or fqn == "up")
    assert decisions["up"] == "fp8: module_filter returned True"
    assert decisions["down"] == "kept: module_filter returned False"
    assert "odd" not in seen  # alignment is checked before the filter is asked
    model = Block(64, 128)
    decisions = fp8.convert(model, min_features=0)
    assert is_fp8(model, "up") and is_fp8(model, "down") and not is_fp8(model, "odd")


def test_subclasses_and_already_converted_layers():
    model = torch.nn.Sequential(Subclassed(32, 32), fp8.Linear(32, 32))
    decisions = fp8.convert(model, min_features=0)
    assert decisions["0"].startswith("kept: a subclass of nn.Linear (Subclassed)")
    assert decisions["1"].startswith("fp8: already an ampfuse.fp8.Linear")


def test_refusals_leave_the_model_unchanged():
    model = Block(64, 128)
    with raises_naming("include names 'odd'", "not a multiple of 16"):
        fp8.convert(model, min_features=0, include=["odd"])
    assert not fp8.fp8_modules(model)  # decided everything before converting anything
    with raises_naming(r"\['upp'\] name no nn.Linear", "down"):
        fp8.convert(model, exclude=["upp"])
    with pytest.raises(TypeError, match="include must be a list"):
        fp8.convert(model, include="up")
    with pytest.raises(TypeError, match="module_filter must be a callable"):
        fp8.convert(model, module_filter=True)
    with raises_naming("min_features must be an int >= 0"):
        fp8.convert(model, min_features=-1)
    with raises_naming("module_filter or min_features, not both"):
        fp8.convert(model, module_filter=lambda f, m: True, min_features=0)
    assert not fp8.fp8_modules(model)


def setup(verbosity=1, **options):
    model = Block(64, 128)
    optimizer = torch.optim.AdamW(model.parameters())
    return amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16,
                          verbosity=verbosity, **options)


def test_initialize_prints_each_decision_at_verbosity_1(capsys):
    model, _ = setup(fp8=True, fp8_include=["up"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "amp fp8 (CurrentScaling): 1 of 3 Linear layers compute in FP8"
    assert "amp fp8:   up: fp8: in include" in lines
    assert any(line.startswith("amp fp8:   down: kept: 128 -> 64: GEMM too small")
               for line in lines)
    assert is_fp8(model, "up") and not is_fp8(model, "down")
    assert model.up.weight.dtype == torch.bfloat16
    setup(verbosity=0, fp8=fp8.RowwiseScaling(), fp8_min_features=0)
    assert capsys.readouterr().out == ""


def test_initialize_options():
    model, _ = setup(verbosity=0, fp8=fp8.RowwiseScaling(), fp8_exclude=["down"],
                     fp8_module_filter=lambda fqn, m: True)
    assert is_fp8(model, "up") and not is_fp8(model, "down")
    assert isinstance(model.up.fp8_recipe, fp8.RowwiseScaling)
    with pytest.warns(UserWarning, match="no Linear layer was converted"):
        model, _ = setup(verbosity=0, fp8=True)
    assert not fp8.fp8_modules(model)
    with raises_naming("fp8_min_features choose which Linears", "fp8 is off"):
        setup(fp8=False, fp8_min_features=0)
    with pytest.raises(TypeError, match="CurrentScaling.*RowwiseScaling.*DelayedScaling"):
        setup(fp8="rowwise")


def test_initialize_with_several_models_prefixes_the_names(capsys):
    models = [Block(64, 128), Block(64, 128)]
    amp.initialize(models, opt_level="O2", dtype=torch.bfloat16, fp8=True,
                   fp8_include=["model1.up"])
    assert not is_fp8(models[0], "up") and is_fp8(models[1], "up")
    assert "amp fp8:   model1.up: fp8: in include" in capsys.readouterr().out
    with raises_naming(r"fp8_include names \['up'\]"):
        amp.initialize([Block(64, 128), Block(64, 128)], opt_level="O2",
                       dtype=torch.bfloat16, fp8=True, fp8_include=["up"])
