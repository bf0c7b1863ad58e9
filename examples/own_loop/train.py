"""pytorch/examples' MNIST script, kept as it is written, with the handful of lines that make it a
spottrain job (each marked ``# spottrain``). The data are synthetic 28x28 digits-like images (a
class is a stroke pattern), so the example needs no download; swap in torchvision's MNIST as
the original does.

    python -m trainer run --script examples/own_loop/train.py --steps 300 --run-dir run
    SPOTTRAIN_CONFIG=trainer.toml python examples/own_loop/train.py    # by hand, the settings in a file

docs/porting.md shows the diff against the original.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR

import trainer.run  # spottrain


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


class Strokes(torch.utils.data.Dataset):
    """``n`` 28x28 images: class c is a bar at an angle of c * 18 degrees, with noise."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        label = int(torch.randint(10, (1,), generator=g))
        angle = torch.tensor(label * 3.14159 / 10)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, 28), torch.linspace(-1, 1, 28), indexing="ij")
        bar = ((xs * torch.sin(angle) - ys * torch.cos(angle)).abs() < 0.15).float()
        return bar.unsqueeze(0) + 0.3 * torch.randn(1, 28, 28, generator=g), label


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--samples", type=int, default=6000)
    args = parser.parse_args()

    run = trainer.run.start()  # spottrain: settings, device, lock, lease
    model = run.wrap(Net().to(run.device))  # spottrain: DDP on several ranks
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    train_loader = run.batches(Strokes(args.samples), batch_size=args.batch_size)  # spottrain
    steps_per_epoch = args.samples // (args.batch_size * run.world_size)
    run.track(model=model, optimizer=optimizer, scheduler=scheduler)  # spottrain: restores them

    model.train()
    for step in run.steps():  # spottrain: was `for epoch ...: for data, target in train_loader:`
        data, target = next(train_loader)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        run.log(loss)  # spottrain: was print(...)
        if (step + 1) % steps_per_epoch == 0:
            scheduler.step()  # per epoch, as before


if __name__ == "__main__":
    main()
