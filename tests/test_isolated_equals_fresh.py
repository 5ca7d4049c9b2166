"""An isolated search's answer is the one a user's own fresh process holds under the same
budget: a script started with ``python``, its model warmed up, the budget entered with
``oomguard.budget``, then the step. The workload is a user's, not one of oomguard's: a GRU
language-model step with AdamW, written here, whose per-step tensors (38-115 KiB per time step)
are small enough to come from glibc's heap, where free chunks left by the warm-up used to serve
them uncounted (measured on this step before: isolated 39, a user's process 39 to 41 from run to
run, with 11 MiB of free heap at budget entry)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from oomguard import search

MiB = 1024**2
BUDGET = 120 * MiB
HERE = Path(__file__).resolve().parent


class GruStep:
    """One AdamW training step of a one-layer GRU language model (vocab 512, width 256, 224
    tokens) at ``size`` sequences; ``warmup()`` builds it and runs one step at size 1."""

    name = "user-gru-step"
    steps_per_trial = 2  # the first optimizer step allocates its state

    def __init__(self) -> None:
        self.model = self.optimizer = None

    def __getstate__(self) -> dict:
        return {}  # a child builds its own in warmup()

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def warmup(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(512, 256),
                                          "gru": torch.nn.GRU(256, 256, batch_first=True),
                                          "head": torch.nn.Linear(256, 512)})
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self(1)

    def __call__(self, size: int) -> float:
        tokens = torch.randint(0, 512, (size, 225))
        hidden, _ = self.model["gru"](self.model["embed"](tokens[:, :-1]))
        logits = self.model["head"](hidden)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


USER_SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(HERE)!r})
    import oomguard
    from test_isolated_equals_fresh import GruStep

    step = GruStep()
    step.warmup()
    size = int(sys.argv[1])
    with oomguard.budget({BUDGET}):
        try:
            step(size)
            step(size)
        except RuntimeError as exc:
            if not oomguard.is_oom(exc):
                raise
            print("oom")
            sys.exit(0)
    print("ok")
""")


def _user_process_fits(script: Path, size: int) -> bool:
    """Whether ``size`` runs in a process started as a user starts one (``python script``)."""
    out = subprocess.run([sys.executable, str(script), str(size)], capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1] == "ok"


@pytest.mark.slow
def test_the_isolated_answer_is_what_a_users_fresh_process_holds_under_the_budget(
        tmp_path: Path) -> None:
    result = search(GruStep(), budget=BUDGET, isolate=True, max_size=1024)
    m = result.max_ok
    assert result.first_oom == m + 1, [(t.size, t.ok) for t in result.trials]
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    assert (_user_process_fits(script, m), _user_process_fits(script, m + 1)) == (True, False), m
