"""Small models, synthetic data and snapshots shared by the amp tests.

Every batch is a pure function of (step, seed): a run that is stopped and resumed, or one that
leaves out some steps, sees exactly the batches an uninterrupted run sees at the same step
numbers, with no generator state to carry across.
"""

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 4


def low_dtype(device):
    """The low-precision dtype amp picks by default: bf16 on the CPU, fp16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cpu" else torch.float16


def _generator(step, seed):
    return torch.Generator().manual_seed(1_000_003 * seed + step)


# ---- a CNN with BatchNorm on 8x8 images -------------------------------------------------------

# Class k lights up the k-th 4x4 quadrant of the image; the network has to find which one.
_QUADRANTS = torch.zeros(NUM_CLASSES, 1, 8, 8)
for _k in range(NUM_CLASSES):
    _QUADRANTS[_k, 0, 4 * (_k // 2) : 4 * (_k // 2) + 4, 4 * (_k % 2) : 4 * (_k % 2) + 4] = 1.0


def image_batch(step, seed=0, batch=32, device="cpu"):
    gen = _generator(step, seed)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
    images = _QUADRANTS[labels] + 0.8 * torch.randn(batch, 1, 8, 8, generator=gen)
    return images.to(device), labels.to(device)


class SmallCNN(nn.Module):
    """conv-bn-relu twice, then a linear classifier."""

    def __init__(self, channels=8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, stride=2)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels * 4 * 4, NUM_CLASSES)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.flatten(1))


# ---- a one-block transformer with LayerNorm on token sequences ---------------------------------

VOCAB = 16
SEQ = 8


def token_batch(step, seed=0, batch=32, device="cpu"):
    """Sequences of filler tokens 4..15 with three copies of a marker token 0..3: the label."""
    gen = _generator(step, seed)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
    tokens = torch.randint(NUM_CLASSES, VOCAB, (batch, SEQ), generator=gen)
    where = torch.rand(batch, SEQ, generator=gen).argsort(dim=1)[:, :3]
    tokens.scatter_(1, where, labels[:, None].expand(-1, 3))
    return tokens.to(device), labels.to(device)


class TinyTransformer(nn.Module):
    """Embedding, one multi-head self-attention layer written out with torch.matmul and
    torch.softmax, an MLP, two LayerNorms and a mean-pooled classifier.

    `scores` and `attention` are identity modules placed right after the attention matmul and
    the softmax, so a forward hook on them sees the dtype those ops produced."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.scores = nn.Identity()
        self.attention = nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm2 = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, tokens):
        h = self.embed(tokens)
        b, t, d = h.shape
        q, k, v = (
            x.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
            for x in self.qkv(h).chunk(3, dim=-1)
        )
        scores = self.scores(torch.matmul(q, k.transpose(-2, -1)) * (d // self.heads) ** -0.5)
        attention = self.attention(torch.softmax(scores, dim=-1))
        mixed = torch.matmul(attention.to(v.dtype), v).transpose(1, 2).reshape(b, t, d)
        h = self.norm1(h + self.proj(mixed.to(h.dtype)))
        h = self.norm2(h + self.mlp(h))
        return self.head(h.mean(dim=1))


# ---- a tiny MLP for long runs ------------------------------------------------------------------

MLP_IN = 8


def mlp_batch(step, seed=0, batch=16, device="cpu"):
    """Inputs whose label is the argmax of a fixed linear map of them (plus some noise)."""
    teacher = torch.Generator().manual_seed(12345)
    weights = torch.randn(MLP_IN, NUM_CLASSES, generator=teacher)
    gen = _generator(step, seed)
    x = torch.randn(batch, MLP_IN, generator=gen)
    labels = (x @ weights + 0.3 * torch.randn(batch, NUM_CLASSES, generator=gen)).argmax(dim=1)
    return x.to(device), labels.to(device)


class TinyMLP(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, hidden)
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


MODELS = {
    "cnn": (SmallCNN, image_batch),
    "transformer": (TinyTransformer, token_batch),
    "mlp": (TinyMLP, mlp_batch),
}


def make_model(name, seed=0, device="cpu"):
    """A fresh fp32 model with weights fixed by `seed`, and its batch function."""
    cls, batches = MODELS[name]
    torch.manual_seed(seed)
    return cls().to(device), batches


# ---- optimizers -------------------------------------------------------------------------------

OPTIMIZERS = ("FusedAdam", "AdamW", "SGD")


def make_optimizer(name, params, lr=None, **options):
    """ampfuse's FusedAdam / FusedSGD, or torch.optim.AdamW / SGD, with learning rates that
    train the models above in a few dozen steps; `options` go to the optimizer."""
    from ampfuse.optimizers import FusedAdam, FusedSGD

    params = list(params)
    if name == "FusedAdam":
        return FusedAdam(params, lr=lr or 1e-2, weight_decay=0.01, **options)
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=lr or 1e-2, weight_decay=0.01, **options)
    if name == "SGD":
        return torch.optim.SGD(params, lr=lr or 0.05, momentum=0.9, **options)
    if name == "FusedSGD":
        return FusedSGD(params, lr=lr or 0.05, momentum=0.9, **options)
    raise ValueError(name)


# ---- snapshots of everything a skipped step must leave alone ----------------------------------


def _tensors_of(value, prefix, out):
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone()
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _tensors_of(value[key], f"{prefix}.{key}", out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _tensors_of(item, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


def snapshot(model, optimizer, amp):
    """Copies of the model's parameters, amp's master params and every value in the optimizer's
    state, keyed by where they come from."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = p.detach().clone()
    for i, m in enumerate(amp.master_params(optimizer)):
        out[f"master[{i}]"] = m.detach().clone()
    _tensors_of(optimizer.state_dict()["state"], "optimizer.state", out)
    return out


def _is_fresh_state(key, value, expected):
    """True for optimizer state that a skipped first step may create: a step count of 0,
    all-zero moments, and a master equal to amp's master of that param."""
    if not key.startswith("optimizer.state."):
        return False
    index, _, name = key[len("optimizer.state.") :].partition(".")
    if name == "step":
        return float(value) == 0.0
    if name == "master_param":
        master = expected.get(f"master[{index}]")
        return master is not None and torch.equal(value, master)
    return isinstance(value, torch.Tensor) and not bool(value.any())


def assert_same_snapshot(actual, expected, what, allow_fresh_state=False):
    """Bit-identical (same dtype, same bits) tensors and equal other values, key for key.

    allow_fresh_state: `actual` may also hold optimizer state that `expected` lacks, if it is
    what a skipped first step creates (see _is_fresh_state): zeros are the same as no state."""
    from tolerances import assert_close_report

    extra = set(actual) - set(expected)
    if allow_fresh_state:
        stale = sorted(k for k in extra if not _is_fresh_state(k, actual[k], expected))
        assert not stale, f"{what}: new state that is not a fresh zero state: {stale}"
    else:
        assert not extra, f"{what}: new keys {sorted(extra)}"
    missing = set(expected) - set(actual)
    assert not missing, f"{what}: lost keys {sorted(missing)}"
    for key, value in expected.items():
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            got = actual[key]
            assert got.dtype == value.dtype and torch.equal(got, value), (
                f"{what}: {key} is {got!r}, expected {value!r}"
            )
        elif isinstance(value, torch.Tensor):
            assert_close_report(actual[key], value, exact=True, msg=f"{what}: {key}")
        else:
            assert actual[key] == value, f"{what}: {key} is {actual[key]!r}, expected {value!r}"


def all_finite(snap):
    return all(
        bool(torch.isfinite(v).all())
        for v in snap.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )


# ---- the training loop of the resume tests (shared with their subprocess) ----------------------


def train_steps(model, optimizer, amp, batches, start, stop, overflow_steps=()):
    """apex-style steps start..stop-1 on the step-numbered batches; at `overflow_steps` the loss
    is multiplied by inf, so that step overflows and is skipped."""
    for step in range(start, stop):
        inputs, targets = batches(step)
        loss = F.cross_entropy(model(inputs), targets)
        if step in overflow_steps:
            loss = loss * float("inf")
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
