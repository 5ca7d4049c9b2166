"""Training loops as users write them, under a CPU budget: each client's native tool against oomguard.

Three clients, each with an effective batch (rows per optimizer step) that does not fit its
budget: a nanoGPT-style loop, the transformers ``Trainer`` and a Lightning module (the
last two from examples/trainer_script.py and examples/lightning_script.py). Each variant
runs in a fresh process: the warm-up, then a real ``RLIMIT_DATA`` budget, then its search,
then optimizer steps of the real loop at what it found. For the nanoGPT-style loop:

- **native**: accelerate's recipe, ``find_executable_batch_size`` around the whole loop
  (accelerate >= 1.9 multiplies the size by 0.9 after each OOM and restarts the loop); the
  batch it settles on is the effective batch, which therefore shrinks.
- **oomguard**: ``oomguard.search(step, restore=(model, optimizer))`` finds the largest
  micro-batch at which the loop's whole step runs (the effective batch in micro-batches,
  each backward adding into the gradients, then ``optimizer.step()``), and the loop runs
  ``oomguard.accumulate`` over ``EFFECTIVE`` rows at that micro-batch (the largest that
  ran, ``max_ok``, or the recommendation, ``size_to_use``, the default margin below it), so
  the effective batch is kept exactly.

For the Trainer, native is ``auto_find_batch_size=True`` (accelerate's helper restarting the
inner loop at x0.9) and oomguard ``OomguardTrainer``; for Lightning, native is
``BatchSizeFinder(mode="binsearch")`` and oomguard ``BatchSizeCallback``. Both oomguard
integrations keep the effective batch (micro-batch x gradient accumulation).

Columns: the micro-batch found, the search's trials (restarts for the native tool), the
OOMs during the ``STEPS`` steps after it, the effective batch of those steps, seconds to the
answer (also over the trials times two optimizer steps of the loop it found, the goal
being at most 1) and in all (also as a ratio to the native tool's), and the micro-batch over the
loop's own maximum m: the largest size at which ``CHECK_STEPS`` steps of the plain loop run
in a fresh process (bisected, a fresh process per size; for the frameworks, their own loop at
that per-device batch with two micro-batches per step, as the split runs).

    .venv/bin/python bench/clients.py [--steps 100] [--framework-steps 10]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from typing import Any

import torch

from oomguard.engine.core.child import Child, start_forkserver

EFFECTIVE = 128  # rows per optimizer step
SEQ, VOCAB = 32, 2048
BUDGET = 160 * 1024**2
CHECK_STEPS = 3
PRELOAD = ("transformers",)
# The frameworks' clients: the examples' tiny GPT-2 under 40 MiB, 480 rows per step (480 has
# many divisors, so the micro-batch can be close to what fits).
FRAMEWORK_EFFECTIVE = 480
FRAMEWORK_BUDGET = 40 * 1024**2
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ, bos_token_id=0, eos_token_id=0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _rows(n: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _warm(model: torch.nn.Module) -> None:
    ids = _rows(1, -1)[:, :8]
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def _plain_steps(size: int, steps: int) -> bool:
    """Whether ``steps`` optimizer steps at batch ``size`` run under the budget (fresh process)."""
    import oomguard

    model, opt = _model()
    _warm(model)
    with oomguard.budget(BUDGET, "cpu"):
        def run() -> None:
            for i in range(steps):
                ids = _rows(size, i)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        return not _ran_out(run)


def _native(steps: int) -> dict[str, Any]:
    import accelerate.utils

    import oomguard

    model, opt = _model()
    _warm(model)
    tried: list[int] = []
    t0 = time.perf_counter()
    answer: dict[str, Any] = {}

    @accelerate.utils.find_executable_batch_size(starting_batch_size=EFFECTIVE)
    def loop(batch_size: int) -> None:
        tried.append(batch_size)
        answer["found_at"] = time.perf_counter()
        for i in range(steps):
            ids = _rows(batch_size, i)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    with oomguard.budget(BUDGET, "cpu"):
        loop()
    end = time.perf_counter()
    return {"size": tried[-1], "trials": len(tried), "ooms": 0, "effective": tried[-1],
            "step_s": (end - answer["found_at"]) / steps,
            "search_s": answer["found_at"] - t0, "total_s": end - t0,
            "note": f"sizes tried {tried}; an OOM restarts the loop with fewer rows"}


def _oomguard(steps: int, largest: bool) -> dict[str, Any]:
    import oomguard

    model, opt = _model()
    _warm(model)

    def step(size: int) -> None:
        """One optimizer step of the loop as it will run: the effective batch in micro-batches
        of ``size`` rows (the last one shorter), each backward adding into the gradients."""
        ids = _rows(EFFECTIVE, 0)
        for start in range(0, EFFECTIVE, size):
            mb = ids[start:start + size]
            (model(input_ids=mb, labels=mb).loss * (len(mb) / EFFECTIVE)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    with oomguard.budget(BUDGET, "cpu"):
        result = oomguard.search(step, restore=(model, opt), max_size=EFFECTIVE)
        t_search = time.perf_counter()
        # The largest size that ran, or the recommendation (the default margin below it); an
        # OOM in the loop costs accumulate a retry at the size its measured peaks predict,
        # never a changed effective batch.
        micro = result.max_ok if largest else result.size_to_use
        for i in range(steps):
            batch = {"input_ids": _rows(EFFECTIVE, i)}
            oomguard.accumulate(lambda mb: model(input_ids=mb["input_ids"],
                                                 labels=mb["input_ids"]).loss,
                                batch, micro, params=model, optimizer=opt,
                                name="bench-clients")
            opt.step()
            opt.zero_grad(set_to_none=True)
        ooms = oomguard.stats().ooms  # the accumulate calls' OOMs (the search's are trials)
    end = time.perf_counter()
    return {"size": micro, "trials": len(result.trials), "ooms": ooms, "effective": EFFECTIVE,
            "step_s": (end - t_search) / steps, "search_s": t_search - t0, "total_s": end - t0,
            "note": f"max_ok {result.max_ok} (recommended with the default margin: "
                    f"{result.size_to_use})"}


def _true_max(ctx: Any, fits: Any, most: int) -> int:
    """The largest size from 1 to ``most`` at which ``fits(size)`` holds in a fresh process
    (bisected; fitting is monotone in the size)."""
    if _fresh(ctx, fits, most):
        return most
    lo, hi = 1, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fresh(ctx, fits, mid) else (lo, mid)
    return lo


def _loop_fits(size: int) -> bool:
    return _plain_steps(size, CHECK_STEPS)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _trainer(per_device: int, accum: int, steps: int, cls: Any = None,
             options: dict[str, Any] | None = None, **extra: Any) -> Any:
    from trainer_script import make_rows
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    _quiet()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    args = TrainingArguments(
        output_dir="/tmp/oomguard-bench-trainer", per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accum, max_steps=steps, learning_rate=3e-3,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        logging_strategy="no", **extra)
    trainer = (cls or Trainer)(model=GPT2LMHeadModel(config), args=args,
                               train_dataset=make_rows(FRAMEWORK_EFFECTIVE * steps, 0),
                               **(options or {}))
    trainer.model(**trainer.data_collator(make_rows(2, 2))).loss.backward()  # warm-up
    trainer.model.zero_grad(set_to_none=True)
    return trainer


def _trainer_fits(size: int) -> bool:
    import oomguard

    trainer = _trainer(size, 2, 2)
    with oomguard.budget(FRAMEWORK_BUDGET, "cpu"):
        return not _ran_out(trainer.train)


def _trainer_native(steps: int) -> dict[str, Any]:
    import oomguard

    trainer = _trainer(FRAMEWORK_EFFECTIVE, 1, steps, auto_find_batch_size=True)
    tried: list[int] = []
    inner, t0, at = trainer._inner_training_loop, time.perf_counter(), [0.0]

    def recorded(batch_size: int | None = None, *args: Any, **kwargs: Any) -> Any:
        tried.append(batch_size)
        at[0] = time.perf_counter()
        return inner(batch_size, *args, **kwargs)

    trainer._inner_training_loop = recorded
    with oomguard.budget(FRAMEWORK_BUDGET, "cpu"):
        trainer.train()
    end, size = time.perf_counter(), tried[-1]
    return {"size": size, "trials": len(tried), "ooms": 0, "effective": size,
            "search_s": at[0] - t0, "step_s": (end - at[0]) / steps, "total_s": end - t0,
            "note": f"per-device batches tried {tried}"}


def _trainer_oomguard(steps: int, largest: bool) -> dict[str, Any]:
    import oomguard
    from oomguard.integrations import OomguardTrainer

    trainer = _trainer(FRAMEWORK_EFFECTIVE, 1, steps, cls=OomguardTrainer,
                       options={"oomguard_largest": largest})
    t0 = time.perf_counter()
    with oomguard.budget(FRAMEWORK_BUDGET, "cpu"):
        ooms = _ran_out(trainer.train)  # the Trainer's loop has no retry: an OOM ends it
    a = trainer.args
    return _split_row(trainer.oomguard_train, a.per_device_train_batch_size
                      * a.gradient_accumulation_steps, ooms, trainer.state.global_step, t0, steps)


def _lightning(batch: int, accum: int, steps: int, callback: Any) -> tuple[Any, Any]:
    import lightning.pytorch as pl
    from lightning_script import Sequences, TinyLM

    _quiet()
    torch.manual_seed(0)
    module, data = TinyLM(), Sequences(batch, FRAMEWORK_EFFECTIVE * (steps + 8))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         callbacks=[callback] if callback else [], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accum,
                         default_root_dir="/tmp/oomguard-bench-lightning")
    module.net(input_ids=data.ids[:2], labels=data.ids[:2]).loss.backward()  # warm-up
    module.zero_grad(set_to_none=True)
    return (module, data), trainer


def _lightning_fits(size: int) -> bool:
    import oomguard

    (module, data), trainer = _lightning(size, 2, 2, None)
    with oomguard.budget(FRAMEWORK_BUDGET, "cpu"):
        return not _ran_out(lambda: trainer.fit(module, data))


def _lightning_native(steps: int) -> dict[str, Any]:
    """Lightning's ``BatchSizeFinder(mode="binsearch")`` as examples/lightning_script.py runs
    it, then the fit at the size it reported, in the same process and under the same budget."""
    import lightning_script

    import oomguard

    _quiet()
    t0 = time.perf_counter()
    size = lightning_script.finder("binsearch", FRAMEWORK_EFFECTIVE, FRAMEWORK_BUDGET)
    t_found = time.perf_counter()
    (module, data), trainer = _lightning(size, 1, steps, None)
    with oomguard.budget(FRAMEWORK_BUDGET, "cpu"):
        ooms = _ran_out(lambda: trainer.fit(module, data))
    end = time.perf_counter()
    return {"size": size, "trials": "-", "ooms": ooms, "effective": size,
            "search_s": t_found - t0, "step_s": (end - t_found) / steps, "total_s": end - t0,
            "note": f"BatchSizeFinder binsearch reported {size}"}


def _lightning_oomguard(steps: int, largest: bool) -> dict[str, Any]:
    import oomguard
    from oomguard.integrations import BatchSizeCallback

    callback = BatchSizeCallback(largest=largest)
    (module, data), trainer = _lightning(FRAMEWORK_EFFECTIVE, 1, steps, callback)
    t0 = time.perf_counter()
    with oomguard.budget(FRAMEWORK_BUDGET, "cpu"):
        ooms = _ran_out(lambda: trainer.fit(module, data))
    return _split_row(callback.split, data.batch_size * trainer.accumulate_grad_batches, ooms,
                      trainer.global_step, t0, steps)


def _split_row(split: Any, effective: int, ooms: int, done: int, t0: float, steps: int
               ) -> dict[str, Any]:
    """The row of an integration's run: its :class:`Split`, the effective batch it ran, its
    OOMs and the optimizer steps done, timed from ``t0``."""
    end, search_s = time.perf_counter(), split.search.seconds
    return {"size": split.micro_batch, "trials": len(split.search.trials), "ooms": ooms,
            "effective": effective, "search_s": search_s,
            "step_s": (end - t0 - search_s) / steps, "total_s": end - t0,
            "note": f"{split.micro_batch} x {split.accumulation}, largest that ran {split.found}"
                    + (f"; the run ran out of memory after {done} steps" if ooms else "")}


def _ran_out(run: Any) -> int:
    """1 if ``run()`` ran out of memory (the frameworks' loops end there), else 0."""
    import oomguard

    try:
        run()
    except Exception as exc:  # noqa: BLE001 - Lightning wraps some errors; is_oom reads the chain
        if not any(oomguard.is_oom(e) for e in (exc, exc.__cause__, exc.__context__) if e):
            raise
        return 1
    return 0


def _fresh(ctx: Any, fn: Any, *args: Any) -> Any:
    with Child(ctx, fn, *args) as child:
        return child.wait().result()


def _table(title: str, rows: dict[str, dict[str, Any]], effective: int, m: int,
           steps: int) -> None:
    base = rows[next(iter(rows))]["total_s"]
    print(f"\n{title}; the loop's own maximum m = {m}")
    print(f"| variant | micro-batch | trials | OOMs in {steps} steps | effective batch "
          "| search s | search / (trials x 2 steps) | total s | total / native | micro / m |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        ratio = (f"{r['search_s'] / (r['trials'] * 2 * r['step_s']):.2f}"
                 if isinstance(r["trials"], int) else "-")
        print(f"| {name} | {r['size']} | {r['trials']} | {r['ooms']} | {r['effective']}"
              f"{'' if r['effective'] == effective else ' (changed)'} | {r['search_s']:.1f} "
              f"| {ratio} | {r['total_s']:.1f} | {r['total_s'] / base:.2f} | {r['size'] / m:.2f} |")
    for name, r in rows.items():
        print(f"- {name}: {r['note']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps after the search "
                   "(nanoGPT-style loop)")
    p.add_argument("--framework-steps", type=int, default=10,
                   help="optimizer steps of the Trainer and Lightning runs")
    p.add_argument("--clients", default="loop,trainer,lightning",
                   help="which clients, comma-separated (default: all three)")
    args = p.parse_args(argv)
    ctx = start_forkserver(PRELOAD)
    steps, fsteps, clients = args.steps, args.framework_steps, args.clients.split(",")
    if "loop" in clients:
        _loop_table(ctx, steps)
    where = (f"GPT-2 1x32, seq 32, AdamW, effective batch {FRAMEWORK_EFFECTIVE}, CPU budget "
             f"{FRAMEWORK_BUDGET // 2**20} MiB")
    if "trainer" in clients:
        _trainer_table(ctx, fsteps, where)
    if "lightning" in clients:
        _lightning_table(ctx, fsteps, where)


def _loop_table(ctx: Any, steps: int) -> None:
    loop = {"native (accelerate)": _fresh(ctx, _native, steps),
            "oomguard, largest that ran": _fresh(ctx, _oomguard, steps, True),
            "oomguard, recommended": _fresh(ctx, _oomguard, steps, False)}
    _table(f"nanoGPT-style loop: GPT-2 2x128, seq {SEQ}, AdamW, effective batch {EFFECTIVE}, "
           f"CPU budget {BUDGET // 2**20} MiB", loop, EFFECTIVE,
           _true_max(ctx, _loop_fits, EFFECTIVE), steps)


def _trainer_table(ctx: Any, fsteps: int, where: str) -> None:
    trainer = {"native (auto_find_batch_size)": _fresh(ctx, _trainer_native, fsteps),
               "OomguardTrainer, largest that ran": _fresh(ctx, _trainer_oomguard, fsteps, True),
               "OomguardTrainer, recommended": _fresh(ctx, _trainer_oomguard, fsteps, False)}
    _table(f"transformers Trainer: {where}", trainer, FRAMEWORK_EFFECTIVE,
           _true_max(ctx, _trainer_fits, FRAMEWORK_EFFECTIVE), fsteps)


def _lightning_table(ctx: Any, fsteps: int, where: str) -> None:
    lightning = {"native (BatchSizeFinder binsearch)": _fresh(ctx, _lightning_native, fsteps),
                 "BatchSizeCallback, largest that ran": _fresh(ctx, _lightning_oomguard, fsteps,
                                                               True),
                 "BatchSizeCallback, recommended": _fresh(ctx, _lightning_oomguard, fsteps,
                                                          False)}
    _table(f"Lightning: {where}", lightning, FRAMEWORK_EFFECTIVE,
           _true_max(ctx, _lightning_fits, FRAMEWORK_EFFECTIVE), fsteps)


if __name__ == "__main__":
    main()
