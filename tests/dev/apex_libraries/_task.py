"""The learnable synthetic task the checks train on: a noisy 3 x 16 x 16 image whose bright
quadrant is its class (4 classes), and a small CNN for it."""

import torch

CLASSES = 4


def quadrant_images(count, seed, brightness):
    """(images, labels) of `count` samples drawn from torch.Generator(seed)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (count,), generator=gen)
    images = torch.randn(count, 3, 16, 16, generator=gen)
    for i, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[i, :, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += brightness
    return images, labels


def small_cnn():
    """Conv, batch norm, pool, conv, pool, linear: a batch norm for O1/O2's kept norms."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(128, CLASSES))
