"""Training loops as users write them, under a CPU budget: oomguard's documented adoption against
plain halving and each client's native tool, and against the loop's own maximum.

Five clients, each with an effective batch (rows per optimizer step) that does not fit its
budget:

- **loop**: a nanoGPT-style loop (GPT-2, AdamW) as examples/nanogpt_loop.py adopts oomguard:
  ``search(step, restore=(model, optimizer))``, ``micro_batches(effective, size_to_use)``,
  then ``accumulate`` in each micro-step with the user's backward weighted by its rows;
- **trainer**: ``OomguardTrainer`` for ``transformers.Trainer``;
- **lightning**: ``BatchSizeCallback`` on a Lightning module;
- **accelerate**: a loop prepared by accelerate's ``Accelerator`` (a pure-torch GPT), the
  step searched with ``restore=``, then ``accumulate(step, batch, size_to_use,
  backward=accelerator.backward)`` over the whole effective batch;
- **conv**: a small ResNet-like net (Conv2d + BatchNorm2d blocks) on 32x32 images, adopted as
  the loop is, with ``accumulate`` over the whole batch.

The loop's own maximum m is the largest micro-batch at which a fresh process runs
``--check-steps`` (20) real optimizer steps of the client's own loop, two micro-batches per
step, without oomguard (bisected, a fresh process per size). Each variant runs in a fresh
process: the warm-up, then a real ``RLIMIT_DATA`` budget, its search, then ``--steps`` (200)
optimizer steps of the real loop:

- **oomguard**: the documented adoption at its defaults;
- **halving**: the effective batch kept, the micro-batch halved from the whole batch until it
  runs (``accumulate(policy=Halve())`` for the loops; a fresh Trainer or fit at half the
  micro-batch and twice the accumulation for the frameworks);
- **native**: accelerate's ``find_executable_batch_size`` around the whole loop (x0.9 and a
  restart after each OOM), ``auto_find_batch_size=True`` for the Trainer, Lightning's
  ``BatchSizeFinder(mode="binsearch")``; each changes the effective batch.

Columns: the micro-batches of a step, the largest micro-batch oomguard allows over m (goal:
0.95 to 1), the micro-batches per step against the fewest that m allows and the fewest that
run (the effective batch split as ``micro_batches`` splits it, counted up from m's in
fresh processes: unequal micro-batches are two shapes, and a conv net on a CPU keeps oneDNN
kernels for each), the effective batch run, the OOMs in the run (the frameworks' loops end
at their first), and samples per second per CPU second of each variant's configuration (one
thread: on a machine of its own, per second), with its ratio to oomguard's, then the same
rate under the budget. The rates are measured side by side after the runs: each
configuration runs ``--timing-steps`` (10) optimizer steps in a fresh process without the
budget, then under it, the variants interleaved, ``--rounds`` (3) times; a rate is rows
over the median step's CPU time, and the row shows the median over the rounds. Without the
budget is what a user's process gets: under a CPU budget glibc serves every block of
128 KiB or more with a fresh mmap, so a step with large blocks pays their page faults every
time (the conv net's 40-row micro-batches lose about 2.7x, its 2-row ones nothing).

    .venv/bin/python bench/clients.py [--steps 200] [--check-steps 20] [--clients loop,conv]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread: the cores are shared; ratios hold
# The swallowed-OOM detector wraps every operator of an oomguard call under a CPU budget (up to
# 1.77x a step; on a GPU it reads a counter): off, the rows compare configurations, not it.
os.environ.setdefault("OOMGUARD_SWALLOWED_OOMS", "off")
import torch  # noqa: E402 - after the thread count

from oomguard.engine.core.child import Child, start_forkserver  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
MiB = 1024**2
PRELOAD = ("transformers", "accelerate", "lightning.pytorch")


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _ran_out(run: Callable[[], Any]) -> int:
    """1 if ``run()`` ran out of memory (a framework's loop ends there), else 0."""
    import oomguard

    try:
        run()
    except Exception as exc:  # noqa: BLE001 - Lightning wraps some errors; is_oom reads the chain
        if not any(oomguard.is_oom(e) for e in (exc, exc.__cause__, exc.__context__) if e):
            raise
        return 1
    return 0


def _halvings(effective: int) -> Iterator[int]:
    """The micro-batches plain halving tries: the effective batch, its half, ... (rows)."""
    size = effective
    while size >= 1:
        yield size
        size //= 2


def _current(name: str) -> int | None:
    """The micro-batch an ``accumulate`` of ``name`` runs at now (None: the whole batch)."""
    import oomguard

    current = oomguard.stats().sizes[name].current
    return current.get("micro_batch_size") if isinstance(current, dict) else current


class Clock:
    """When each optimizer step of a run ended, in this process's CPU seconds (the first "end"
    is when the clock started); its rate from the median step. CPU time, because the runs
    share 2 cores with other work: a step's wall time also counts its waits for a core
    (measured: the same configuration at 131 and 169 rows per wall second side by side), and
    every run here is one thread. The median, so that the first step (the optimizer's state,
    the dataloader's start) does not decide a row."""

    def __init__(self) -> None:
        self.ends: list[float] = [time.process_time()]

    def tick(self) -> None:
        self.ends.append(time.process_time())

    def per_s(self, rows: int) -> float:
        """Rows per CPU second at the median step (0 where no step ran)."""
        steps = sorted(b - a for a, b in itertools.pairwise(self.ends))
        return rows / steps[len(steps) // 2] if steps else 0.0


def _row(sizes: list[int] | None, effective: int, ooms: int, steps: int, clock: Clock,
         **extra: Any) -> dict[str, Any]:
    """A variant's run: ``steps`` optimizer steps of ``effective`` rows, timed by ``clock``."""
    return {"sizes": sizes, "effective": effective, "ooms": ooms, "steps": steps,
            "per_s": clock.per_s(effective)} | extra


# --- the loops a user writes ------------------------------------------------------------------


class _Runs:
    """What every client's ``timed`` gives: whether its loop runs at given micro-batches."""

    def runs(self, sizes: list[int], steps: int) -> bool:
        """Whether ``steps`` optimizer steps at micro-batches ``sizes`` run under the budget."""
        return not _ran_out(lambda: self.timed(sizes, steps, True))  # type: ignore[attr-defined]


class Loop(_Runs):
    """The nanoGPT-style loop: a GPT-2 language model, AdamW, batches of token rows."""

    name = "loop"
    effective, budget = 160, 160 * MiB
    seq, vocab = 32, 2048

    def parts(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=self.vocab, n_positions=self.seq,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch(self, rows: int, step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        return {"ids": torch.randint(0, self.vocab, (rows, self.seq), generator=g)}

    def loss(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(input_ids=mb["ids"], labels=mb["ids"]).loss

    def setup(self) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                             Callable[[torch.Tensor], Any]]:
        """Model, optimizer and the loop's backward, warmed up (one small step's kernels and
        thread pools) before any budget."""
        model, opt = self.parts()
        self.loss(model, self.batch(2, -1)).backward()
        model.zero_grad(set_to_none=True)
        return model, opt, lambda loss: loss.backward()

    def fits(self, micro: int, steps: int) -> bool:
        """The loop's own maximum's test: ``steps`` optimizer steps of two ``micro``-row
        micro-batches each run under the budget."""
        import oomguard

        model, opt, backward = self.setup()

        def run() -> None:
            for i in range(steps):
                for j in range(2):
                    backward(self.loss(model, self.batch(micro, 2 * i + j)) / 2)
                opt.step()
                opt.zero_grad(set_to_none=True)

        with oomguard.budget(self.budget, "cpu"):
            return not _ran_out(run)

    def timed(self, sizes: list[int], steps: int, budgeted: bool) -> float:
        """Rows per second of the loop at micro-batches ``sizes`` (median step), each loss
        weighted by its rows, under the budget or (``budgeted`` False) as a user's process
        runs it: a configuration's own speed."""
        model, opt, backward = self.setup()
        total = sum(sizes)
        with _limit(self.budget, budgeted):
            clock = Clock()
            for i in range(steps):
                for j, rows in enumerate(sizes):
                    backward(self.loss(model, self.batch(rows, len(sizes) * i + j))
                             * (rows / total))
                opt.step()
                opt.zero_grad(set_to_none=True)
                clock.tick()
        return clock.per_s(total)

    def searched(self, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 backward: Callable[[torch.Tensor], Any]) -> Any:
        """The documented search (docs/guides/training-search.md): the loop's whole step at
        ``size`` rows, two micro-batches where it accumulates (the second a row shorter),
        model and optimizer restored after every trial."""
        import oomguard
        from oomguard.engine.util.rows import slice_rows

        probe, e = self.batch(self.effective, -2), self.effective

        def step(size: int) -> float:
            for rows in (size,) if size >= e else (size, max(1, size - 1)):
                loss = self.loss(model, slice_rows(probe, 0, rows))
                backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return oomguard.search(step, restore=(model, opt), max_size=self.effective)

    # Per micro-step (examples/nanogpt_loop.py), else the whole batch per accumulate call.
    micro_steps = True

    def oomguard(self, steps: int) -> dict[str, Any]:
        """The documented adoption: the searched size, then ``accumulate`` in each micro-step
        (its backward weighted by the micro-batch's rows) or over the whole batch."""
        import oomguard
        from oomguard.engine.util.rows import slice_rows
        from oomguard.training import micro_batches

        model, opt, backward = self.setup()
        e = self.effective
        with oomguard.budget(self.budget, "cpu"):
            t0 = time.perf_counter()
            result = self.searched(model, opt, backward)
            sizes = micro_batches(e, result.size_to_use)
            t1, clock = time.perf_counter(), Clock()
            for i in range(steps):
                batch, stop = self.batch(e, i), 0
                for rows in sizes if self.micro_steps else ():
                    start, stop = stop, stop + rows
                    oomguard.accumulate(
                        lambda mb: self.loss(model, mb), slice_rows(batch, start, stop),
                        params=model, optimizer=opt, name="bench-clients",
                        backward=lambda loss, share=rows / e: backward(loss * share))
                if not self.micro_steps:
                    oomguard.accumulate(lambda mb: self.loss(model, mb), batch,
                                        result.size_to_use, params=model, optimizer=opt,
                                        backward=backward, name="bench-clients")
                opt.step()
                opt.zero_grad(set_to_none=True)
                clock.tick()
        if not self.micro_steps:  # what accumulate ran at last (its retries shrink it)
            sizes = micro_batches(e, _current("bench-clients") or result.size_to_use)
        return _row(sizes, e, oomguard.stats().ooms, steps, clock, search_s=t1 - t0,
                    allowed=result.size_to_use, found=result.max_ok)

    def halving(self, steps: int) -> dict[str, Any]:
        """``accumulate`` over the whole batch from the whole batch down, halving on OOM."""
        import oomguard
        from oomguard.retry import Halve
        from oomguard.training import micro_batches

        model, opt, backward = self.setup()
        with oomguard.budget(self.budget, "cpu"):
            clock = Clock()
            for i in range(steps):
                oomguard.accumulate(lambda mb: self.loss(model, mb), self.batch(self.effective, i),
                                    self.effective, params=model, optimizer=opt,
                                    backward=backward, policy=Halve(), name="bench-halving")
                opt.step()
                opt.zero_grad(set_to_none=True)
                clock.tick()
        sizes = micro_batches(self.effective, _current("bench-halving") or self.effective)
        return _row(sizes, self.effective, oomguard.stats().ooms, steps, clock)

    def native(self, steps: int) -> dict[str, Any]:
        """accelerate's recipe: ``find_executable_batch_size`` around the whole loop; the
        batch it settles on is the effective batch, which therefore shrinks."""
        import accelerate.utils

        import oomguard

        model, opt, backward = self.setup()
        tried: list[int] = []
        clock = [Clock()]

        @accelerate.utils.find_executable_batch_size(starting_batch_size=self.effective)
        def loop(batch_size: int) -> None:
            tried.append(batch_size)
            clock[0] = Clock()
            for i in range(steps):
                backward(self.loss(model, self.batch(batch_size, i)))
                opt.step()
                opt.zero_grad(set_to_none=True)
                clock[0].tick()

        with oomguard.budget(self.budget, "cpu"):
            t0 = time.process_time()
            loop()
        return _row([tried[-1]], tried[-1], len(tried) - 1, steps, clock[0],
                    search_cpu_s=clock[0].ends[0] - t0, note=f"sizes tried {tried}")


class Accelerate(Loop):
    """A pure-torch GPT (examples/nanogpt_loop.py's) prepared by accelerate's ``Accelerator``;
    every backward is ``accelerator.backward``."""

    name = "accelerate"
    effective, budget = 160, 80 * MiB
    micro_steps = False  # docs/guides/accumulate.md: accumulate(..., backward=accelerator.backward)

    def parts(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from nanogpt_loop import TinyGPT

        torch.manual_seed(0)
        model = TinyGPT(dim=128, heads=4, layers=4)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch(self, rows: int, step: int) -> dict[str, torch.Tensor]:
        from nanogpt_loop import BLOCK, VOCAB

        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, VOCAB, (rows, BLOCK + 1), generator=g)
        return {"x": ids[:, :-1].contiguous(), "y": ids[:, 1:].contiguous()}

    def loss(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(mb["x"], mb["y"])

    def setup(self) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                             Callable[[torch.Tensor], Any]]:
        from accelerate import Accelerator

        model, opt = self.parts()
        accelerator = Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        self.loss(model, self.batch(2, -1)).backward()
        model.zero_grad(set_to_none=True)
        return model, opt, accelerator.backward


class _Block(torch.nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, a 1x1 projection where the
    shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out))
        self.skip = (nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class Conv(Loop):
    """A small ResNet-like net on 32x32 images (10 classes), SGD with momentum, the whole
    batch per ``accumulate`` call."""

    name = "conv"
    effective, budget = 160, 64 * MiB

    def parts(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        nn = torch.nn
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            _Block(16, 16, 1), _Block(16, 32, 2), _Block(32, 64, 2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def batch(self, rows: int, step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        return {"x": torch.randn(rows, 3, 32, 32, generator=g),
                "y": torch.randint(0, 10, (rows,), generator=g)}

    def loss(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(mb["x"]), mb["y"])

    micro_steps = False


# --- the frameworks ---------------------------------------------------------------------------


def _token_rows(n: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


class TrainerClient(_Runs):
    """The transformers Trainer on a GPT-2, AdamW (its defaults: gradient clipping at 1)."""

    name = "trainer"
    effective, budget = 128, 100 * MiB
    seq, vocab = 64, 512

    def trainer(self, per_device: int, accumulation: int, steps: int, cls: Any = None,
                **options: Any) -> Any:
        from transformers import (
            GPT2Config,
            GPT2LMHeadModel,
            Trainer,
            TrainerCallback,
            TrainingArguments,
        )

        _quiet()
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=self.vocab,
                            n_positions=self.seq, bos_token_id=0, eos_token_id=0,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        args = TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="oomguard-bench-"), seed=0,
            per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
            max_steps=steps, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, logging_strategy="no",
            auto_find_batch_size=options.pop("auto_find_batch_size", False))
        self.clock = clock = Clock()

        class Ticks(TrainerCallback):
            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                clock.tick()

        trainer = (cls or Trainer)(model=GPT2LMHeadModel(config), args=args,
                                   train_dataset=_token_rows(self.effective * steps, self.seq,
                                                             self.vocab),
                                   callbacks=[Ticks()], **options)
        warm = trainer.data_collator(_token_rows(2, self.seq, self.vocab))
        trainer.model(**warm).loss.backward()  # warm-up before the budget
        trainer.model.zero_grad(set_to_none=True)
        return trainer

    def fits(self, micro: int, steps: int) -> bool:
        import oomguard

        trainer = self.trainer(micro, 2, steps)
        with oomguard.budget(self.budget, "cpu"):
            return not _ran_out(trainer.train)

    def timed(self, sizes: list[int], steps: int, budgeted: bool) -> float:
        """Rows per second of the Trainer at micro-batches ``sizes`` (median step): its own
        accumulation where they are equal, else ``OomguardTrainer``'s split without a search."""
        from oomguard.engine.integrations.hf_trainer import use_train_split
        from oomguard.engine.integrations.sizing import Split
        from oomguard.integrations import OomguardTrainer

        split = Split(sum(sizes), sizes[0], len(sizes), None, None, tuple(sizes))
        trainer = self.trainer(split.micro_batch, split.accumulation, steps,
                               cls=None if split.equal else OomguardTrainer)
        if not split.equal:
            trainer.oomguard_train = split
            use_train_split(trainer, split)
        with _limit(self.budget, budgeted):
            trainer.train()
        return self.clock.per_s(split.effective)

    def oomguard(self, steps: int) -> dict[str, Any]:
        import oomguard
        from oomguard.integrations import OomguardTrainer

        trainer = self.trainer(self.effective, 1, steps, cls=OomguardTrainer)
        with oomguard.budget(self.budget, "cpu"):
            ooms = _ran_out(trainer.train)
        split = trainer.oomguard_train
        return _row(list(split.sizes), self.effective, ooms, trainer.state.global_step,
                    self.clock, search_s=split.search.seconds, allowed=split.allowed,
                    found=split.found)

    def halving(self, steps: int) -> dict[str, Any]:
        import oomguard

        ooms = 0
        for micro in _halvings(self.effective):
            accumulation = math.ceil(self.effective / micro)
            trainer = self.trainer(micro, accumulation, steps)
            with oomguard.budget(self.budget, "cpu"):
                failed = _ran_out(trainer.train)
            if not failed:
                return _row([micro] * accumulation, micro * accumulation, ooms,
                            trainer.state.global_step, self.clock)
            ooms += 1
        raise RuntimeError("no micro-batch ran")

    def native(self, steps: int) -> dict[str, Any]:
        import oomguard

        trainer = self.trainer(self.effective, 1, steps, auto_find_batch_size=True)
        tried: list[int] = []
        inner, at = trainer._inner_training_loop, [0.0, 0.0]

        def recorded(batch_size: int | None = None, *args: Any, **kwargs: Any) -> Any:
            tried.append(batch_size)
            at[:] = time.process_time(), time.perf_counter()
            return inner(batch_size, *args, **kwargs)

        trainer._inner_training_loop = recorded
        with oomguard.budget(self.budget, "cpu"):
            t0 = time.perf_counter()
            trainer.train()
        self.clock.ends = [at[0], *(t for t in self.clock.ends if t > at[0])]  # the last try's
        return _row([tried[-1]], tried[-1], len(tried) - 1, trainer.state.global_step,
                    self.clock, search_s=at[1] - t0, note=f"per-device batches tried {tried}")


class LightningClient(_Runs):
    """A Lightning module around a GPT-2 (examples/lightning_script.py's, larger), AdamW."""

    name = "lightning"
    effective, budget = 160, 100 * MiB
    seq, vocab = 64, 512

    def fit(self, batch_size: int, accumulation: int, steps: int, callback: Any = None
            ) -> tuple[Any, Any, Any]:
        import lightning.pytorch as pl
        from transformers import GPT2Config, GPT2LMHeadModel

        _quiet()
        seq, vocab = self.seq, self.vocab

        class Data(pl.LightningDataModule):
            def __init__(self, rows: int) -> None:
                super().__init__()
                self.batch_size = batch_size
                g = torch.Generator().manual_seed(0)
                self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

            def train_dataloader(self) -> torch.utils.data.DataLoader:
                return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.ids),
                                                   batch_size=self.batch_size, shuffle=True)

        class LM(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = GPT2LMHeadModel(GPT2Config(
                    n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=seq,
                    bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0))

            def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
                (ids,) = batch
                return self.net(input_ids=ids, labels=ids).loss

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        self.clock = clock = Clock()

        class Ticks(pl.Callback):
            def on_before_optimizer_step(self, *args: Any) -> None:
                clock.tick()

        torch.manual_seed(0)
        module, data = LM(), Data(self.effective * (steps + 2))
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                             callbacks=[Ticks(), *([callback] if callback else [])],
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accumulate_grad_batches=accumulation,
                             default_root_dir=tempfile.mkdtemp(prefix="oomguard-bench-"))
        ids = data.ids[:2]
        module.net(input_ids=ids, labels=ids).loss.backward()  # warm-up before the budget
        module.zero_grad(set_to_none=True)
        return module, data, trainer

    def fits(self, micro: int, steps: int) -> bool:
        import oomguard

        module, data, trainer = self.fit(micro, 2, steps)
        with oomguard.budget(self.budget, "cpu"):
            return not _ran_out(lambda: trainer.fit(module, data))

    def timed(self, sizes: list[int], steps: int, budgeted: bool) -> float:
        """Rows per second of the fit at micro-batches ``sizes`` (median step): Lightning's own
        accumulation where they are equal, else ``BatchSizeCallback``'s loader and weights
        without a search."""
        from oomguard.engine.integrations.sizing import Split
        from oomguard.integrations import BatchSizeCallback

        split = Split(sum(sizes), sizes[0], len(sizes), None, None, tuple(sizes))

        class Preset(BatchSizeCallback):
            def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
                self.split = split
                self._hand_out(trainer, pl_module, split)

        if split.equal:
            module, data, trainer = self.fit(split.micro_batch, split.accumulation, steps)
        else:
            module, data, trainer = self.fit(split.effective, split.accumulation, steps,
                                             Preset())
        with _limit(self.budget, budgeted):
            trainer.fit(module, data)
        return self.clock.per_s(split.effective)

    def oomguard(self, steps: int) -> dict[str, Any]:
        import oomguard
        from oomguard.integrations import BatchSizeCallback

        callback = BatchSizeCallback()
        module, data, trainer = self.fit(self.effective, 1, steps, callback)
        with oomguard.budget(self.budget, "cpu"):
            ooms = _ran_out(lambda: trainer.fit(module, data))
        split = callback.split
        return _row(list(split.sizes), self.effective, ooms, trainer.global_step, self.clock,
                    search_s=split.search.seconds, allowed=split.allowed, found=split.found)

    def halving(self, steps: int) -> dict[str, Any]:
        import oomguard

        ooms = 0
        for micro in _halvings(self.effective):
            accumulation = math.ceil(self.effective / micro)
            module, data, trainer = self.fit(micro, accumulation, steps)
            with oomguard.budget(self.budget, "cpu"):
                failed = _ran_out(lambda: trainer.fit(module, data))  # noqa: B023 - called now
            if not failed:
                return _row([micro] * accumulation, micro * accumulation, ooms,
                            trainer.global_step, self.clock)
            ooms += 1
        raise RuntimeError("no micro-batch ran")

    def native(self, steps: int) -> dict[str, Any]:
        """``BatchSizeFinder(mode="binsearch")`` then the fit at the size it reported, in the
        same process and under the same budget."""
        from lightning.pytorch.callbacks import BatchSizeFinder

        import oomguard

        finder = BatchSizeFinder(mode="binsearch", init_val=2, steps_per_trial=2,
                                 max_val=self.effective)
        module, data, trainer = self.fit(2, 1, 1, finder)
        with oomguard.budget(self.budget, "cpu"):
            t0 = time.perf_counter()
            with contextlib.suppress(Exception):  # the one step after it may still run out
                trainer.fit(module, data)
            size = finder.optimal_batch_size
            t1 = time.perf_counter()
            module, data, trainer = self.fit(size, 1, steps)
            ooms = _ran_out(lambda: trainer.fit(module, data))
        return _row([size], size, ooms, trainer.global_step, self.clock, search_s=t1 - t0,
                    note=f"BatchSizeFinder binsearch reported {size}")


CLIENTS: dict[str, Any] = {c.name: c for c in (Loop, TrainerClient, LightningClient,
                                                Accelerate, Conv)}


def _limit(budget: int, budgeted: bool) -> contextlib.AbstractContextManager[Any]:
    """The client's CPU budget, or nothing: under a CPU budget glibc serves every block of
    128 KiB or more with a fresh mmap (so that frees leave ``VmData``), and a step pays the
    page faults of its large blocks every time: a speed no user's process has."""
    import oomguard

    return oomguard.budget(budget, "cpu") if budgeted else contextlib.nullcontext()


def _client(name: str, sizes: dict[str, int]) -> Any:
    """Client ``name`` with its ``effective`` batch and ``budget`` changed as ``sizes`` says."""
    client = CLIENTS[name]()
    for key, value in sizes.items():
        setattr(client, key, value)
    return client


def _call(client: str, sizes: dict[str, int], method: str, *args: Any) -> Any:
    """``client``'s ``method(*args)``: what a fresh process runs."""
    torch.set_num_threads(1)
    return getattr(_client(client, sizes), method)(*args)


def _fresh(ctx: Any, *args: Any) -> Any:
    with Child(ctx, _call, *args) as child:
        return child.wait().result()


def _true_max(ctx: Any, client: str, sizes: dict[str, int], most: int, steps: int) -> int:
    """The largest micro-batch from 1 to ``most`` at which the client's own loop runs
    ``steps`` optimizer steps in a fresh process (bisected; fitting is monotone)."""
    if _fresh(ctx, client, sizes, "fits", most, steps):
        return most
    lo, hi = 1, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fresh(ctx, client, sizes, "fits", mid, steps) else (lo, mid)
    return lo


VARIANTS = ("oomguard", "halving", "native")


def _time_side_by_side(ctx: Any, name: str, sizes: dict[str, int], row: dict[str, Any],
                       rounds: int, steps: int) -> None:
    """Each variant's configuration (the micro-batches its run settled on) timed in fresh
    processes, without the budget (``per_s``: what a user's process gets) and under it
    (``budget_per_s``), the variants interleaved in every round (in a rotated order), so that
    the load of the shared cores falls on all alike; each rate is the median over rounds,
    and the run's own rate is kept as ``run_per_s``."""
    ran = [v for v in VARIANTS if "failed" not in row[v]]
    rates: dict[tuple[str, bool], list[float]] = {}
    for r in range(rounds):
        for variant in ran[r % len(ran):] + ran[:r % len(ran)]:
            for budgeted in (False, True):
                rates.setdefault((variant, budgeted), []).append(_fresh(
                    ctx, name, sizes, "timed", row[variant]["sizes"], steps, budgeted))
    for variant in ran:
        row[variant]["run_per_s"] = row[variant]["per_s"]
        for key, budgeted in (("per_s", False), ("budget_per_s", True)):
            got = sorted(rates[variant, budgeted])
            row[variant][key] = got[len(got) // 2]


def _fewest_passes(ctx: Any, client: str, sizes: dict[str, int], effective: int, m: int,
                   steps: int) -> int:
    """The fewest micro-batches per optimizer step at which the client's loop runs its
    effective batch split as :func:`~oomguard.engine.util.rows.micro_batches` splits it,
    from the fewest that m allows up (a fresh process each). Unequal micro-batches are two
    shapes, and on a CPU a conv net keeps oneDNN kernels for each: the split of m's passes
    may not run where two equal micro-batches of m did."""
    from oomguard.engine.util.rows import micro_batches

    passes = math.ceil(effective / m)
    while passes < effective and not _fresh(ctx, client, sizes, "runs", micro_batches(
            effective, math.ceil(effective / passes)), steps):
        passes += 1
    return passes


def _describe(sizes: list[int] | None) -> str:
    if not sizes:
        return "-"
    if len(set(sizes)) == 1:
        return f"{sizes[0]} x {len(sizes)}"
    return " + ".join(map(str, sizes))


def _print_table(results: dict[str, dict[str, Any]], steps: int) -> None:
    print(f"\n| client (effective batch, budget) | m | variant | micro-batches | allowed / m "
          f"| passes (fewest at m; that run) | effective run | OOMs in {steps} steps "
          "| samples/s | / oomguard's | under the budget |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        (effective, budget), m = r["client"], r["m"]
        base = r["oomguard"].get("per_s") or float("nan")
        fewest = f"{math.ceil(effective / m)}; {r['runs']}"
        first = f"{name} ({effective} rows, {budget // MiB} MiB)"
        for variant in VARIANTS:
            v = r[variant]
            if "failed" in v:
                print(f"| {first} | {m} | {variant} | failed: {v['failed'][:80]} "
                      "| | | | | | | |")
                first = ""
                continue
            allowed = f"{v['allowed'] / m:.2f}" if "allowed" in v else "-"
            passes = f"{len(v['sizes'])} ({fewest})" if v["effective"] == effective else "-"
            kept = v["effective"] if v["effective"] == effective \
                else f"**{v['effective']} (changed)**"
            done = "" if v["steps"] == steps else f" (ended at step {v['steps']})"
            print(f"| {first} | {m} | {variant} | {_describe(v['sizes'])} | {allowed} "
                  f"| {passes} | {kept} | {v['ooms']}{done} | {v['per_s']:.1f} "
                  f"| {v['per_s'] / base:.2f} | {v['budget_per_s']:.1f} |")
            first = ""  # the client on its first row only
        for variant in ("oomguard", "native"):
            v = r[variant]
            extra = [f"search {v['search_s']:.1f} s"] if "search_s" in v else []
            extra += [f"restarts {v['search_cpu_s']:.1f} CPU s"] if "search_cpu_s" in v else []
            extra += [f"largest that ran {v['found']}"] if "found" in v else []
            extra += [v["note"]] if "note" in v else []
            if extra:
                print(f"- {name}, {variant}: " + "; ".join(extra))


def _summary(v: dict[str, Any]) -> str:
    """One variant's run in a few words, for the progress lines."""
    if "failed" in v:
        return f"failed ({v['failed'][:60]})"
    return f"{_describe(v['sizes'])} {v['per_s']:.1f}/s {v['ooms']} OOMs"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=200,
                   help="optimizer steps of each variant's run (late OOMs counted over them)")
    p.add_argument("--check-steps", type=int, default=20,
                   help="optimizer steps a size must run to count towards the loop's maximum")
    p.add_argument("--clients", default=",".join(CLIENTS),
                   help=f"comma-separated, of {', '.join(CLIENTS)} (default: all)")
    p.add_argument("--budget", action="append", default=[], metavar="CLIENT=MIB",
                   help="another CPU budget for a client, in MiB (repeatable)")
    p.add_argument("--effective", action="append", default=[], metavar="CLIENT=ROWS",
                   help="another effective batch for a client, in rows (repeatable)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the side-by-side timing of the variants' configurations")
    p.add_argument("--timing-steps", type=int, default=10,
                   help="optimizer steps each configuration runs per round")
    p.add_argument("--max-only", action="store_true",
                   help="only bisect each client's own maximum (to choose budgets)")
    args = p.parse_args(argv)
    names = [n for n in args.clients.split(",") if n]
    given = {"budget": _pairs(p, args.budget, MiB), "effective": _pairs(p, args.effective, 1)}
    unknown = sorted((set(names) | set(given["budget"]) | set(given["effective"])) - set(CLIENTS))
    if unknown:
        p.error(f"unknown client(s) {', '.join(unknown)}: give some of {', '.join(CLIENTS)}")
    ctx = start_forkserver(PRELOAD)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.perf_counter()
        sizes = {key: values[name] for key, values in given.items() if name in values}
        client = _client(name, sizes)
        m = _true_max(ctx, name, sizes, client.effective, args.check_steps)
        row = {"m": m, "client": (client.effective, client.budget),
               "runs": _fewest_passes(ctx, name, sizes, client.effective, m, args.check_steps)}
        if args.max_only:
            print(f"{name}: m {m}, {row['runs']} passes ({client.effective} rows, {client.budget // MiB} MiB, "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
            continue
        for variant in VARIANTS:
            try:
                row[variant] = _fresh(ctx, name, sizes, variant, args.steps)
            except Exception as exc:  # noqa: BLE001 - a variant that fails is a row that says so
                row[variant] = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        _time_side_by_side(ctx, name, sizes, row, args.rounds, args.timing_steps)
        results[name] = row
        print(f"{name}: {time.perf_counter() - t0:.0f} s; m {row['m']}; " + "; ".join(
            f"{v} {_summary(row[v])}" for v in VARIANTS), flush=True)
    if results:
        _print_table(results, args.steps)


def _pairs(p: argparse.ArgumentParser, given: list[str], unit: int) -> dict[str, int]:
    """``CLIENT=N`` options as {client: N x unit}; a bad one is argparse's one-line error."""
    out = {}
    for item in given:
        name, _, number = item.partition("=")
        if not number.isdigit() or int(number) <= 0:
            p.error(f"{item!r}: give CLIENT=N with N a positive whole number")
        out[name] = int(number) * unit
    return out


if __name__ == "__main__":
    main()
