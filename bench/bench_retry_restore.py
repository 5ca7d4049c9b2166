"""What a retry's restore costs: the buffer copy of every attempt, and ``restore=``'s snapshot.

Rows (CPU, 1 thread, best of interleaved blocks):

- ``BufferCopy`` (engine/core/snapshot.py) of resnet18 (20 BatchNorm layers, built here:
  the torchvision layout) and of a 12-layer GPT-2 (transformers, no buffers): bytes, the
  microseconds of a take and of a restore, and resnet18's training step at 16 x 3 x 64 x 64
  for scale;
- ``@adaptive(params=model, optimizer=opt)`` against the bare step on a small MLP with a
  BatchNorm: microseconds added per call (the copy, the walk and the optimizer's hooks);
- ``restore=``'s host :class:`Snapshot` at a loop's start: resnet18 with SGD (momentum) and
  the 12-layer GPT-2 with AdamW, both after one step: bytes and milliseconds of a take and
  of a restore.

Run: ``python bench/bench_retry_restore.py [--repeats R]``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from bench_overhead import per_call_us as best_us  # beside this file: one timing rule
from torch import nn

from oomguard.engine.core.snapshot import BufferCopy, Snapshot
from oomguard.engine.training.adaptive import adaptive


class Block(nn.Module):
    """torchvision's BasicBlock: two 3x3 convolutions, each with a BatchNorm."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


def resnet18(classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=64, n_head=2, vocab_size=1000,
                                      n_positions=64))


def trained_once(model: nn.Module, opt: torch.optim.Optimizer,
                 loss: Callable[[], torch.Tensor]) -> None:
    """One step, so that the optimizer's state exists (the loop's start after a warm-up)."""
    loss().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, lm = resnet18(), gpt2()
    images = torch.randn(16, 3, 64, 64)
    labels = torch.randint(10, (16,))
    ids = torch.randint(1000, (4, 64))

    def net_loss() -> torch.Tensor:
        return nn.functional.cross_entropy(net(images), labels)

    def lm_loss() -> torch.Tensor:
        return lm(input_ids=ids, labels=ids).loss

    print("BufferCopy per attempt")
    for name, model in (("resnet18", net), ("gpt2-12", lm)):
        copy = BufferCopy.take([model])
        take = best_us(lambda m=model: BufferCopy.take([m]), 200, args.repeats)
        back = best_us(copy.restore, 200, args.repeats)
        print(f"  {name:10s} {len(copy.slots):4d} buffers {copy.nbytes:9d} B  "
              f"take {take:7.1f} us  restore {back:7.1f} us")
    step_net = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    step_ms = best_us(lambda: trained_once(net, step_net, net_loss), 3, 3) / 1e3
    print(f"  resnet18 training step, 16 x 3 x 64 x 64: {step_ms:.1f} ms")

    mlp = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
    sgd = torch.optim.SGD(mlp.parameters(), lr=0.01)
    x = torch.randn(8, 32)

    def bare(batch_size: int) -> None:
        mlp(x[:batch_size]).sum().backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)

    wrapped = adaptive(batch_size=8, params=mlp, optimizer=sgd)(bare)
    plain = adaptive(batch_size=8)(bare)
    rows = {"bare": lambda: bare(8), "@adaptive()": plain,
            "@adaptive(params, optimizer)": wrapped}
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.repeats):  # interleaved: the machine's load hits every row alike
        for key, fn in rows.items():
            times[key].append(best_us(fn, 300, 1))
    base = statistics.median(times["bare"])
    print(f"MLP + BatchNorm1d step: bare {base:.1f} us")
    for key in list(rows)[1:]:
        print(f"  {key:30s} +{statistics.median(times[key]) - base:6.1f} us per call")

    print("restore= Snapshot at a loop's start (host copy)")
    adamw = torch.optim.AdamW(lm.parameters())
    trained_once(lm, adamw, lm_loss)
    for name, objects in (("resnet18 + SGD", (net, step_net)), ("gpt2-12 + AdamW", (lm, adamw))):
        snap = Snapshot.take(objects)
        take = best_us(lambda o=objects: Snapshot.take(o), 3, args.repeats) / 1e3
        back = best_us(snap.restore, 3, args.repeats) / 1e3
        print(f"  {name:16s} {snap.nbytes / 2**20:7.1f} MiB  take {take:6.1f} ms  "
              f"restore {back:6.1f} ms")


if __name__ == "__main__":
    main()
