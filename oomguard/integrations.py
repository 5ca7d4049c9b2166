"""Training frameworks in one line, each an optional extra (``pip install oomguard[lightning]``;
transformers is a dependency already)::

    from oomguard.integrations import OomguardTrainer     # instead of transformers.Trainer
    trainer = OomguardTrainer(model=model, args=args, train_dataset=train)

    from oomguard.integrations import BatchSizeCallback   # a Lightning callback
    L.Trainer(callbacks=[BatchSizeCallback()]).fit(module, datamodule)

Each searches the framework's real training step (forward, backward, optimizer step) and
keeps the user's effective batch exactly, micro-batching where the configured batch does not
fit. Names are resolved on first use (PEP 562): importing this module imports neither
transformers nor lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {name: module for module, names in {
    "oomguard.engine.integrations.hf_trainer": ("OomguardTrainer", "OomguardTrainerMixin",
                                                "fit_train_batch", "fit_eval_batch"),
    "oomguard.engine.integrations.lightning_callback": ("BatchSizeCallback",),
    "oomguard.engine.integrations.sizing": ("Split",),
    "oomguard.engine.training.accumulate": ("micro_batch_for",),  # also oomguard.micro_batch_for
}.items() for name in names}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'oomguard.integrations' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from oomguard.engine.integrations.hf_trainer import OomguardTrainer as OomguardTrainer
    from oomguard.engine.integrations.hf_trainer import (
        OomguardTrainerMixin as OomguardTrainerMixin,
    )
    from oomguard.engine.integrations.hf_trainer import fit_eval_batch as fit_eval_batch
    from oomguard.engine.integrations.hf_trainer import fit_train_batch as fit_train_batch
    from oomguard.engine.integrations.lightning_callback import (
        BatchSizeCallback as BatchSizeCallback,
    )
    from oomguard.engine.integrations.sizing import Split as Split
    from oomguard.engine.training.accumulate import micro_batch_for as micro_batch_for
