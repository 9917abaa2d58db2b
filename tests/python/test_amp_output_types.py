"""The containers a model hands out keep their types through amp's output (and input) casts.

O1 and O2 cast the floating tensors inside a model's outputs; dicts used to come back as plain
dicts, so a Hugging Face model's ModelOutput lost its attributes and `model(**batch).loss`
raised AttributeError at O1/O2 (while O0/O3, which cast no outputs, worked)."""

import collections

import pytest
import torch

from ampfuse import amp
from ampfuse.amp.tensor_casts import cast_floats
from ampfuse.optimizers import FusedAdam

try:  # in requirements-dev.txt; only the ModelOutput cases need it
    from transformers import modeling_outputs
except ImportError:
    modeling_outputs = None

NEEDS_TRANSFORMERS = pytest.mark.skipif(modeling_outputs is None,
                                        reason="transformers is not installed")

Pair = collections.namedtuple("Pair", "first second")


class Net(torch.nn.Module):
    """Returns its logits inside the container `kind` names."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        logits = self.fc(x)
        loss = logits.float().square().mean()
        if self.kind == "model_output":
            return modeling_outputs.CausalLMOutput(loss=loss, logits=logits)
        if self.kind == "ordered_dict":
            return collections.OrderedDict(logits=logits, loss=loss)
        if self.kind == "defaultdict":
            return collections.defaultdict(list, logits=logits, loss=loss)
        return Pair(logits, loss)


KINDS = [pytest.param("model_output", marks=NEEDS_TRANSFORMERS), "ordered_dict", "defaultdict",
         "namedtuple"]
# The dtype of the logits handed out: O1 and O2 give fp32, O3 keeps the model's dtype.
LOGITS_DTYPE = {"O1": torch.float32, "O2": torch.float32, "O3": torch.bfloat16}


@pytest.mark.parametrize("level", LOGITS_DTYPE)
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_keep_their_container_type(kind, level):
    model = Net(kind)
    optimizer = FusedAdam(model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, dtype=torch.bfloat16,
                                      verbosity=0)
    out = model(torch.randn(2, 8))
    assert type(out) is type(Net(kind)(torch.randn(2, 8)))
    if kind == "namedtuple":
        logits, loss = out.first, out.second
    else:
        logits, loss = out["logits"], out["loss"]
        assert list(out) == list(Net(kind)(torch.randn(2, 8)))  # key order kept
    if kind == "model_output":
        assert out.logits is logits and out.loss is loss  # attributes and items agree
    if kind == "defaultdict":
        assert out.default_factory is list
    assert logits.dtype == LOGITS_DTYPE[level]
    assert loss.dtype == torch.float32
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


@NEEDS_TRANSFORMERS
def test_cast_floats_copies_a_dict_subclass_and_leaves_the_original():
    logits = torch.ones(3, dtype=torch.float16)
    original = modeling_outputs.CausalLMOutput(loss=torch.ones(()), logits=logits)
    cast = cast_floats(original, torch.float32)
    assert type(cast) is type(original) and cast is not original
    assert cast.logits.dtype == torch.float32 and cast["logits"] is cast.logits
    assert cast.loss is original.loss  # already fp32: the same tensor
    assert original.logits is logits  # the model's own output is not changed
    unchanged = collections.OrderedDict(a=torch.ones(1))
    assert cast_floats(unchanged, torch.float32) is unchanged
