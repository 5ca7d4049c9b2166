"""Activation checkpointing per block: same gradients and buffers, fewer saved bytes."""

from __future__ import annotations

import copy

import pytest
import torch

from oomguard.engine.core.recompute import checkpointed, repeated_blocks
from oomguard.engine.errors import UsageError


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(width, width, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


def conv_net(width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, width, 3, padding=1),
                               torch.nn.Sequential(Block(width), Block(width)),
                               torch.nn.Sequential(Block(width), Block(width)),
                               torch.nn.Dropout(0.3),
                               torch.nn.Flatten(), torch.nn.LazyLinear(2)).double()


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes the forward saves for the backward, and the loss."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    return total, loss


def test_the_blocks_are_the_outermost_repeated_modules_in_forward_order() -> None:
    net = conv_net()
    blocks = repeated_blocks(net)
    assert [type(b) for b in blocks] == [Block] * 4
    assert blocks[0] is net[1][0] and blocks[3] is net[2][1]
    assert repeated_blocks(torch.nn.Linear(2, 2)) == []


def test_checkpointed_blocks_give_the_same_gradients_and_batchnorm_statistics() -> None:
    plain, recomputed = conv_net(), conv_net()
    x = torch.randn(4, 3, 12, 12, dtype=torch.float64)
    plain(x), recomputed(x)  # materialise the lazy layer in both
    recomputed.load_state_dict(plain.state_dict())
    torch.manual_seed(5)
    plain_saved, loss = saved_bytes(plain, x)
    loss.backward()
    with checkpointed(recomputed) as blocks:
        torch.manual_seed(5)
        recomputed_saved, loss_r = saved_bytes(recomputed, x)
        loss_r.backward()
    assert len(blocks) == 4
    assert float(loss.detach()) == float(loss_r.detach())
    for p, q in zip(plain.parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    # the running statistics move once per step, not once more in the recomputation
    for (name, a), b in zip(plain.state_dict().items(), recomputed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert recomputed_saved < 0.7 * plain_saved, (recomputed_saved, plain_saved)


def test_every_other_block_is_selective_and_the_model_is_left_as_it_was() -> None:
    net = conv_net()
    with checkpointed(net, every=2) as blocks:
        assert blocks == [net[1][0], net[2][0]]
        assert "forward" in vars(net[1][0]) and "forward" not in vars(net[1][1])
    assert not any("forward" in vars(m) for m in net.modules())


def test_a_model_without_repeated_blocks_is_one_line() -> None:
    with pytest.raises(UsageError, match="no repeated blocks"):
        with checkpointed(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(UsageError):
        with checkpointed(copy.deepcopy(conv_net()), every=0):
            pass
