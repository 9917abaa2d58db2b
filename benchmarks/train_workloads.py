"""The models and data of the training benchmarks (bench_train.py, profile_gpu.py,
bench_amp_overhead.py): a GPT-2-style pre-norm decoder and a ResNet-style CNN built from
torch.nn, their default sizes per device, and a Workload that builds a model and its synthetic
batches (fixed seeds: every row starts from the same weights and sees the same batches). The
models are described in bench_train.py's docstring."""

import torch
import torch.nn.functional as F
from torch import nn

DATA_BATCHES = 2  # distinct batches cycled through, so no step sees the previous one's data

GPT_DEFAULTS = {
    "cuda": dict(layers=12, d_model=768, heads=12, seq=1024, batch=8, vocab=50257),
    "cpu": dict(layers=2, d_model=256, heads=4, seq=128, batch=4, vocab=8192),
}
CNN_DEFAULTS = {
    "cuda": dict(cnn_width=64, cnn_blocks=[2, 2, 2, 2], image_size=224, cnn_batch=128,
                 classes=1000),
    "cpu": dict(cnn_width=16, cnn_blocks=[1, 1, 1, 1], image_size=32, cnn_batch=16, classes=10),
}

# ---- models ------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers, d_model, heads, seq, vocab):
        super().__init__()
        if d_model % heads:
            raise SystemExit(f"--d-model {d_model} is not a multiple of --heads {heads}")
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width, blocks, image_size, classes):
        super().__init__()
        if image_size >= 128:  # ImageNet-style stem: 7x7/2 conv and a 3x3/2 max pool
            stem = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                    nn.MaxPool2d(3, 2, 1)]
        else:  # CIFAR-style stem for small images
            stem = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        layers, cin = [], width
        for stage, count in enumerate(blocks):
            cout = width * 2**stage
            for i in range(count):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.features = nn.Sequential(*stem, *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.features(x))


# ---- workloads ---------------------------------------------------------------------------------


class Workload:
    """A model family at one size: builds the model and the data, computes the loss."""

    def __init__(self, name, args):
        self.name = name
        self.args = args
        self.channels_last = name == "cnn" and args.device == "cuda"
        if name == "gpt":
            self.items_per_step, self.unit = args.batch * args.seq, "tokens"
            self.config = dict(layers=args.layers, d_model=args.d_model, heads=args.heads,
                               seq=args.seq, batch=args.batch, vocab=args.vocab)
        else:
            self.items_per_step, self.unit = args.cnn_batch, "images"
            self.config = dict(width=args.cnn_width, blocks=list(args.cnn_blocks),
                               image_size=args.image_size, batch=args.cnn_batch,
                               classes=args.classes, channels_last=self.channels_last)

    def model(self):
        a = self.args
        if self.name == "gpt":
            model = GPT(a.layers, a.d_model, a.heads, a.seq, a.vocab)
        else:
            model = ResNet(a.cnn_width, a.cnn_blocks, a.image_size, a.classes)
        model = model.to(a.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    def batches(self):
        a = self.args
        gen = torch.Generator(device=a.device).manual_seed(a.seed + 1)
        out = []
        for _ in range(DATA_BATCHES):
            if self.name == "gpt":
                tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen,
                                       device=a.device)
                out.append((tokens[:, :-1], tokens[:, 1:]))
            else:
                images = torch.randn(a.cnn_batch, 3, a.image_size, a.image_size, generator=gen,
                                     device=a.device)
                if self.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                labels = torch.randint(0, a.classes, (a.cnn_batch,), generator=gen,
                                       device=a.device)
                out.append((images, labels))
        return out

    @staticmethod
    def loss(output, target):
        # fp32 loss from whatever dtype the model hands out, the same in every row.
        return F.cross_entropy(output.float().flatten(0, -2), target.flatten())
