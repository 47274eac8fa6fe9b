"""Vision models: a residual convnet trained on random batches of square images of random
sides (`convnet`), and torchvision's Mask R-CNN trained on images of random sizes with random
numbers of boxes (`detection`)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from allocator_ext.workloads.base import Batch, Workload, autocast, generator, train_step


class ResidualConv(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.skip = (nn.Identity() if stride == 1 and channels_in == channels_out else
                     nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                   nn.BatchNorm2d(channels_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ConvNet(nn.Module):
    def __init__(self, channels: list[int], classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, channels[0], 7, 2, 3, bias=False),
                                   nn.BatchNorm2d(channels[0]), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
        previous = channels[0]
        for i, c in enumerate(channels):
            layers += [ResidualConv(previous, c, 1 if i == 0 else 2), ResidualConv(c, c, 1)]
            previous = c
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(previous, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class ConvTraining(Workload):
    """A training step on a random batch of square images of a random side, as detection or
    multi-resolution training sees them: activation sizes change every step."""

    name = "convnet"

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        # cuDNN's benchmark mode would try algorithms per shape and cache their workspaces: off,
        # so that what the allocator sees is the model's own tensors.
        torch.backends.cudnn.benchmark = False
        channels = [8, 16] if tiny else [64, 128, 256, 512]
        self.classes = 10 if tiny else 1000
        super().__init__(ConvNet(channels, self.classes), device, random.Random(seed))
        self.sides = [32, 48] if tiny else list(range(128, 417, 32))
        self.batch = (2, 3) if tiny else (8, 64)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def draw(self, largest: bool = False) -> Batch:
        side = self.sides[-1] if largest or self.fixed_shapes else self.rng.choice(self.sides)
        batch = self._pick(self.batch, largest)
        images = torch.randn(batch, 3, side, side, device=self.device)
        return images, torch.randint(0, self.classes, (batch,), device=self.device)

    def run(self, batch: Batch) -> None:
        images, labels = batch
        with autocast(self.device):
            loss = F.cross_entropy(self.model(images).float(), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)



class Detection(Workload):
    """torchvision's Mask R-CNN (ResNet-50 with FPN, built without weights) trained on batches of
    2-4 images, each of its own random height and width (480-1024 px) with 1-24 random boxes
    and their masks. The model's transform scales every image to a short side of 800 px (a
    long side of at most 1333) and pads the batch to the largest of each, so the batch's
    shape follows the images' aspect ratios and orientations; how many proposals reach the
    box and mask heads follows the tensor values, drawn from the workload's seed too."""

    name = "detection"

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        from torchvision.models.detection import maskrcnn_resnet50_fpn

        self.classes = 3 if tiny else 91
        # Small images and samplers at the tiny size, so that a CPU step takes seconds.
        options = (dict(min_size=64, max_size=96, rpn_pre_nms_top_n_train=200,
                        rpn_post_nms_top_n_train=100, box_batch_size_per_image=32)
                   if tiny else {})
        model = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None,
                                      num_classes=self.classes, **options)
        super().__init__(model.train(), device, random.Random(seed))
        self.sides = list(range(48, 97, 16)) if tiny else list(range(480, 1025, 32))
        self.batch = (1, 2) if tiny else (2, 4)
        self.boxes = (1, 3) if tiny else (1, 24)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.002, momentum=0.9,
                                         weight_decay=1e-4)

    def _image_size(self, index: int, largest: bool) -> tuple[int, int]:
        if largest or self.fixed_shapes:
            # Scaled, the most pixels an image can have is a long side at its cap; landscape and
            # portrait in turn make the padded batch square at that side, its largest.
            short, long = self.sides[-1] * 600 // 1000 // 16 * 16, self.sides[-1]
            return (short, long) if index % 2 == 0 else (long, short)
        return self.rng.choice(self.sides), self.rng.choice(self.sides)

    def draw(self, largest: bool = False) -> Batch:
        count = self._pick(self.batch, largest)
        sizes = [self._image_size(i, largest) for i in range(count)]
        boxes = [self._pick(self.boxes, largest) for _ in range(count)]
        g = generator(self.device, self._value_seed(largest))
        images, targets = [], []
        for (h, w), k in zip(sizes, boxes, strict=True):
            images.append(torch.randn(3, h, w, generator=g, device=self.device))
            # Boxes of at least 8 px a side anywhere in the image, each mask its box filled.
            corner = torch.rand(k, 2, generator=g, device=self.device) * torch.tensor(
                [w - 8, h - 8], device=self.device)
            extent = 8 + torch.rand(k, 2, generator=g, device=self.device) * (
                torch.tensor([w, h], device=self.device) - corner - 8)
            box = torch.cat([corner, corner + extent], dim=1)
            ys = torch.arange(h, device=self.device).view(1, h, 1)
            xs = torch.arange(w, device=self.device).view(1, 1, w)
            x1, y1, x2, y2 = (box[:, i].view(k, 1, 1) for i in range(4))
            masks = ((ys >= y1) & (ys < y2) & (xs >= x1) & (xs < x2)).to(torch.uint8)
            labels = torch.randint(1, self.classes, (k,), generator=g, device=self.device)
            targets.append({"boxes": box, "labels": labels, "masks": masks})
        return images, targets

    def run(self, batch: Batch) -> None:
        images, targets = batch
        losses = self.model(images, targets)
        train_step(self, sum(losses.values()))


def build(name: str, device: torch.device, tiny: bool, seed: int) -> Workload:
    if name == "convnet":
        return ConvTraining(device, tiny, seed)
    assert name == "detection", name
    return Detection(device, tiny, seed)
