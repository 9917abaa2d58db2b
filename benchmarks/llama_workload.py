"""The Llama-style decoder of the FP8 benchmarks (bench_fp8_train.py, bench_fp8_layer.py): the
model, its default sizes per device, learnable synthetic data, and how many layers fit a GPU.

Model: token embedding, `layers` pre-norm blocks (RMSNorm, causal scaled_dot_product_attention
with grouped-query heads and rotary positions, RMSNorm, SwiGLU feed-forward), a final RMSNorm
and an untied output projection. The projection is a plain Parameter used through F.linear,
not an nn.Linear, so that no FP8 conversion (ampfuse's or torchao's) takes it: every FP8 row
converts exactly the blocks' seven Linears per layer, as torchtitan's float8 recipe does.
Only torch, no other package.

Data: random tokens are not learnable, and a loss comparison over hundreds of steps needs a
loss that falls. Each sequence is a walk on a fixed random graph: every token has BRANCHES
possible successors, picked uniformly, so the best achievable loss is ln(BRANCHES) and the
starting loss about ln(vocab).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

BRANCHES = 4

LLAMA_DEFAULTS = {
    # Llama-3-8B's layer shape (hidden 4096, FFN 14336, 32 query heads, 8 key/value heads) with
    # Llama 2's 32000-token vocabulary; layers=None: as many as fit (fit_layers).
    "cuda": {"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "seq": 2048,
             "micro_batch": 1, "accum": 4, "vocab": 32000, "layers": None},
    "cpu": {"hidden": 64, "ffn": 192, "heads": 4, "kv_heads": 2, "seq": 32, "micro_batch": 2,
            "accum": 4, "vocab": 256, "layers": 2},
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # The statistics in fp32 whatever the model's dtype, as Llama's reference does.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight.type_as(x)


def rotary_tables(seq, head_dim, device, base=500000.0):
    freqs = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """x [batch, heads, seq, head_dim], rotated pairwise (first half against second half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).type_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, hidden, ffn, heads, kv_heads):
        super().__init__()
        if hidden % heads or heads % kv_heads:
            raise SystemExit(f"hidden {hidden} must divide by heads {heads}, and heads by "
                             f"kv_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attn_norm = RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.ffn_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers, hidden, ffn, heads, kv_heads, seq, vocab, **_):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, ffn, heads, kv_heads)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.output = nn.Parameter(torch.empty(vocab, hidden))
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        nn.init.normal_(self.output, std=0.02)
        self.seq, self.head_dim = seq, hidden // heads

    def forward(self, idx):
        x = self.embed(idx)
        cos, sin = rotary_tables(idx.shape[1], self.head_dim, idx.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.linear(self.norm(x), self.output.type_as(x))


def params_per_layer(hidden, ffn, heads, kv_heads, **_):
    kv = kv_heads * (hidden // heads)
    return 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden


# Bytes per parameter of the hungriest row: ampfuse O2 keeps a bf16 weight (2) and grad (2),
# an fp32 master (4), its fp32 grad (4) and Adam's two moments (8); torch AMP keeps fp32
# weights, grads and moments (16) and autocast's bf16 weight copies (2) during the forward.
# The FP8 rows keep O2's 20 and the cached FP8 weight and its transpose (1 + 1).
STATE_BYTES_PER_PARAM = 22
# Activations kept for the backward per token and layer, in bf16 elements: the two norms'
# inputs and outputs, q, attention output (and o's input), k, v, and the SwiGLU's gate, up,
# silu(gate) and product; x1.5 for fp32 norm statistics, FP8 copies and temporaries.
ACTIVATION_SLACK = 1.5
# Of the card's memory: allocator fragmentation, cuBLAS workspaces, the CUDA context.
HEADROOM = 0.88
RESERVE_BYTES = 2 * 2**30  # the optimizer step's temporaries, the loss's fp32 logits and grads


def fit_layers(cfg, total_bytes):
    """(layers, explanation): as many layers as fit `total_bytes` with fp32 masters."""
    per_param = STATE_BYTES_PER_PARAM
    tokens = cfg["micro_batch"] * cfg["seq"]
    kv = cfg["kv_heads"] * (cfg["hidden"] // cfg["heads"])
    act = ACTIVATION_SLACK * 2 * tokens * (7 * cfg["hidden"] + 2 * kv + 4 * cfg["ffn"])
    layer = params_per_layer(**cfg) * per_param + act
    fixed = 2 * cfg["vocab"] * cfg["hidden"] * per_param + tokens * cfg["vocab"] * 12
    budget = HEADROOM * total_bytes - RESERVE_BYTES - fixed
    layers = max(1, int(budget // layer))
    per_layer = params_per_layer(**cfg)
    why = (f"{layers} layers fit {total_bytes / 2**30:.1f} GiB: {per_layer / 1e6:.0f}M "
           f"params/layer x {per_param} B (fp32 masters, Adam) + {act / 2**30:.2f} GiB activations "
           f"= {layer / 2**30:.2f} GiB/layer; embedding+output {fixed / 2**30:.2f} GiB; "
           f"{HEADROOM:.0%} of memory less {RESERVE_BYTES / 2**30:.0f} GiB reserve")
    return layers, why


def param_count(cfg):
    return cfg["layers"] * params_per_layer(**cfg) + 2 * cfg["vocab"] * cfg["hidden"] + cfg[
        "hidden"]


def markov_batches(cfg, count, device, seed):
    """`count` micro-batches (tokens, targets) of walks on a fixed random successor graph."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    successors = torch.randint(0, cfg["vocab"], (cfg["vocab"], BRANCHES), generator=gen)
    rows = count * cfg["micro_batch"]
    walk = torch.empty(rows, cfg["seq"] + 1, dtype=torch.long)
    walk[:, 0] = torch.randint(0, cfg["vocab"], (rows,), generator=gen)
    choice = torch.randint(0, BRANCHES, (rows, cfg["seq"]), generator=gen)
    for t in range(cfg["seq"]):
        walk[:, t + 1] = successors[walk[:, t], choice[:, t]]
    walk = walk.to(device).view(count, cfg["micro_batch"], cfg["seq"] + 1)
    return [(w[:, :-1], w[:, 1:]) for w in walk]


def loss_floor():
    return math.log(BRANCHES)
