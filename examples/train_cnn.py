"""A small CNN on generated images, sharded with FSDP: nothing in torchacc is specific to GPT.

    torchrun --nproc_per_node=2 examples/train_cnn.py                   # FSDP over 2 ranks
    torchrun --nproc_per_node=4 examples/train_cnn.py --fsdp_size 2     # HSDP: 2 replicas of 2 shards
    python examples/train_cnn.py --steps 20                             # one process works too

The images are made on the fly: a bright square on noise, and the label is the quadrant it sits in.
Each ConvBlock (conv, group norm, ReLU, pooling) becomes one FSDP unit; the classifier head belongs
to the root unit. GroupNorm rather than BatchNorm: FSDP does not synchronize BatchNorm statistics.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import torchacc


class QuadrantSquares(Dataset):
    """``size`` RGB images of ``image_size`` pixels; label = the quadrant (0-3) holding a bright square."""

    def __init__(self, size: int, image_size: int = 32, seed: int = 0) -> None:
        self.size, self.image_size, self.seed = size, image_size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        half, side = self.image_size // 2, self.image_size // 4
        label = int(torch.randint(0, 4, (), generator=gen))
        image = 0.3 * torch.randn(3, self.image_size, self.image_size, generator=gen)
        top = (label // 2) * half + int(torch.randint(0, half - side + 1, (), generator=gen))
        left = (label % 2) * half + int(torch.randint(0, half - side + 1, (), generator=gen))
        image[:, top : top + side, left : left + side] += 1.0 + torch.rand(3, 1, 1, generator=gen)
        return image, label


class ConvBlock(nn.Module):
    """conv 3x3 -> GroupNorm -> ReLU -> 2x2 max-pool: halves the resolution."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(4, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)


class SmallCNN(nn.Module):
    """Three ConvBlocks (32 -> 4 pixels), then a linear classifier over the flattened feature map."""

    def __init__(self, num_classes: int = 4, width: int = 16, image_size: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(3, width), ConvBlock(width, 2 * width), ConvBlock(2 * width, 4 * width))
        self.head = nn.Linear(4 * width * (image_size // 8) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fsdp_size", type=int, default=None, help="ranks that shard the model; default: all")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = SmallCNN()
    loader = DataLoader(QuadrantSquares(4096), batch_size=args.batch_size, shuffle=True, drop_last=True)

    config = torchacc.Config()
    config.compute.bf16 = args.bf16
    config.dist.fsdp.size = args.fsdp_size or torchacc.dist.world_size()
    config.dist.fsdp.wrap_layer_cls = {"ConvBlock"}
    model, loader = torchacc.accelerate(model, loader, config)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    while len(losses) < args.steps:
        for images, labels in loader:  # already on the device, this rank's share of the data
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(torchacc.dist.reduce(loss.detach()).item())
            if len(losses) == args.steps:
                break

    # Every rank scores the same held-out images; the forward is a collective, so all ranks run it.
    held_out = QuadrantSquares(256, seed=1)
    images = torch.stack([held_out[i][0] for i in range(len(held_out))])
    labels = torch.tensor([held_out[i][1] for i in range(len(held_out))])
    with torch.no_grad():
        accuracy = (model(images.to(model.device)).argmax(dim=1) == labels.to(model.device)).float().mean().item()
    if torchacc.dist.is_master_ordinal(local=False):
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, held-out accuracy {accuracy:.0%} "
            f"after {len(losses)} steps on {torchacc.dist.world_size()} rank(s)"
        )


if __name__ == "__main__":
    main()
