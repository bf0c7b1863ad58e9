"""An own-loop script for the tests: the shape of a user's loop, with switches for the ports the
trainer must refuse. ``--after FILE`` writes FILE after the loop (only a finished run gets there)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import trainer.run

p = argparse.ArgumentParser()
p.add_argument("--after", type=Path)
p.add_argument("--plain-loader", action="store_true", help="iterate a torch DataLoader of its own (refused)")
p.add_argument("--unwrapped", action="store_true", help="leave the model out of run.wrap (refused on 2 ranks)")
p.add_argument("--layers", type=int, default=2)
a = p.parse_args()

run = trainer.run.start()
layers = [torch.nn.Linear(16, 16) for _ in range(a.layers)]
net = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())], torch.nn.Linear(16, 1))
model = net if a.unwrapped else run.wrap(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, run.total_steps)
data = torch.utils.data.TensorDataset(torch.randn(512, 16, generator=torch.Generator().manual_seed(1)),
                                      torch.randn(512, 1, generator=torch.Generator().manual_seed(2)))
if a.plain_loader:
    loader = iter(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
else:
    batches = run.batches(data)
run.track(model=model, optimizer=opt, scheduler=sched)
for step in run.steps():
    x, y = next(loader) if a.plain_loader else next(batches)
    loss = torch.nn.functional.mse_loss(model(torch.nn.functional.dropout(x, 0.1)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    run.log(loss, grad_free=float(y.mean()))
if a.after is not None:
    a.after.write_text(f"finished at {step + 1}\n")
