"""Data sources for jobs: ``n_samples`` rows of ``seq_len`` token ids.

- ``generated``: :func:`oomguard.metrics.models.make_batch` (seeded random tokens, seeded padding);
- ``text``: the file's bytes are the tokens (vocabulary 256), cut into consecutive
  windows from the start;
- ``tokens``: token ids from a ``.npy`` file (1-D: one stream cut into consecutive
  windows; 2-D: one sample per row, truncated to ``seq_len``) or a text file of
  whitespace-separated integers (one stream);
- ``bytes``: a byte-level corpus read through ``numpy.memmap`` (``uint8``) at seeded
  random positions, as in the E10 setup: only the windows are read, whatever the size.

Every source returns ``input_ids``, ``attention_mask`` (ones, or make_batch's padding)
and ``labels`` (``input_ids``, ``-100`` on padding), each ``[n_samples, seq_len]`` int64.

Data no model can run is refused before any work: a ``seq_len`` below :data:`MIN_SEQ_LEN`
(:func:`check_seq_len_floor`), a batch no device could hold (:func:`check_size`), more
samples than the host's RAM holds (:func:`check_samples`), token ids
outside the vocabulary (:func:`check_vocab`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from oomguard.engine.jobs.records import DataSpec
from oomguard.metrics.models import make_batch

# A causal LM predicts each token from the ones before it: one token has nothing to predict
# (and make_batch's length range would be empty).
MIN_SEQ_LEN = 2
# The most tokens (size x seq_len) a size may ask for at once: their int64 ids alone take
# 8 TiB, more than any device holds, and not far above torch's storage sizes overflow int64.
MAX_TOKENS = 2**40


def _token_stream(path: Path) -> np.ndarray:
    """Token ids of a ``tokens`` file (``.npy`` memory-mapped, or whitespace integers)."""
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    else:
        try:
            arr = np.array(path.read_text(encoding="utf-8").split(), dtype=np.int64)
        except ValueError as exc:
            raise ValueError(f"{path}: not a file of whitespace-separated integers ({exc}); give token "
                             "ids as whitespace-separated integers") from None
    if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D or 2-D array of integer token ids, got "
                         f"{arr.ndim}-D {arr.dtype}; save the ids as one such array")
    return arr


def _need(have: int, spec: DataSpec, what: str) -> None:
    need = spec.n_samples * spec.seq_len
    if have < need:
        raise ValueError(f"{spec.path} has {have} {what}; n_samples x seq_len = "
                         f"{spec.n_samples} x {spec.seq_len} needs {need}; lower n_samples or "
                         "seq_len, or give a longer file")


def check_data(spec: DataSpec) -> None:
    """Check that a file source can give ``n_samples x seq_len`` tokens (ValueError if not).
    Cheap: sizes and headers only, except whitespace token files, which are parsed."""
    if spec.source == "generated" or spec.path is None:
        return
    path = Path(spec.path)
    if spec.source == "text":
        return _need(path.stat().st_size, spec, "bytes")
    if spec.source == "bytes":
        if (size := path.stat().st_size) < spec.seq_len:
            raise ValueError(f"{path} has {size} bytes, fewer than seq_len {spec.seq_len}; "
                             "lower seq_len, or give a longer file")
        return
    arr = _token_stream(path)
    if arr.ndim == 2 and (arr.shape[0] < spec.n_samples or arr.shape[1] < spec.seq_len):
        raise ValueError(f"{path} holds {arr.shape[0]} x {arr.shape[1]} token ids; need at "
                         f"least {spec.n_samples} x {spec.seq_len}; lower n_samples or seq_len, "
                         "or give a longer file")
    if arr.ndim == 1:
        _need(arr.shape[0], spec, "token ids")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{path} holds negative token ids; give ids of 0 or more (a "
                         "tokenizer's output)")


def check_seq_len_floor(seq_len: int, what: str = "seq_len") -> None:
    """ValueError (one line, naming ``what``) for a sequence length below :data:`MIN_SEQ_LEN`."""
    if seq_len < MIN_SEQ_LEN:
        raise ValueError(f"{what} must be at least {MIN_SEQ_LEN} (a causal LM predicts each "
                         f"token from those before it), got {seq_len}; give {MIN_SEQ_LEN} or more")


def check_size(size: int, seq_len: int, what: str) -> None:
    """ValueError (one line, naming ``what``) for a size whose batch of ``size x seq_len``
    tokens passes :data:`MAX_TOKENS` (sizes that are not sample counts too)."""
    if size * max(seq_len, 1) > MAX_TOKENS:
        raise ValueError(f"{what} {size} is too large: {size} x seq_len {seq_len} tokens "
                         f"per step is more than any device holds (at most "
                         f"{MAX_TOKENS // max(seq_len, 1)} at seq_len {seq_len}); lower it")


# Each sample's ids, attention mask and labels: three int64 rows of seq_len
# (docs/measurements.md#hostile-files).
_BYTES_PER_TOKEN = 3 * 8


def check_samples(n_samples: int, seq_len: int, samples: str | None = "n_samples",
                  seq_len_name: str = "seq_len") -> None:
    """ValueError (one line) when the data of ``n_samples x seq_len`` tokens (ids, mask and
    labels: 24 bytes a token, held on the host at once) is larger than this machine's RAM
    (``/proc/meminfo`` ``MemTotal``, measured; unchecked where unreadable). The message asks
    to lower ``samples`` (the option or field that gave the count; None: a default the user
    never gave, so only ``seq_len_name`` is named) or ``seq_len_name``."""
    from oomguard.engine.util.units import fmt_bytes
    from oomguard.probes.host import physical_memory

    need = n_samples * max(seq_len, 1) * _BYTES_PER_TOKEN
    total = physical_memory()[0]
    if not total or need <= total:
        return
    most = total // (max(seq_len, 1) * _BYTES_PER_TOKEN)
    lower = (f"{samples} (at most {most} at this {seq_len_name}) or {seq_len_name}"
             if samples and most >= 1 else seq_len_name)
    raise ValueError(f"{n_samples} sample{'s' * (n_samples != 1)} x {seq_len_name} {seq_len} take {fmt_bytes(need)} "
                     f"on the host (ids, masks and labels), more than its {fmt_bytes(total)} "
                     f"of RAM; lower {lower}")


def check_vocab(spec: DataSpec, vocab_size: int | None, seed: int = 0) -> None:
    """ValueError (one line) when the ids :func:`load_data` gives for ``spec`` (with
    ``seed``) reach past a vocabulary of ``vocab_size`` ids (None: not declared, not
    checked). Reads only the windows used (``n_samples x seq_len`` ids)."""
    if vocab_size is not None and spec.source != "generated":  # generated: drawn below it
        _in_vocab(_token_ids(spec, seed), spec, vocab_size)


def _in_vocab(ids: np.ndarray, spec: DataSpec, vocab_size: int) -> None:
    top = int(ids.max()) if ids.size else 0
    if top >= vocab_size:
        raise ValueError(f"{spec.path}: token id {top} is outside the model's vocabulary "
                         f"({vocab_size} ids, 0-{vocab_size - 1}); "
                         + ("its bytes are the token ids (0-255): give a byte-level model "
                            "vocab_size >= 256" if spec.source in ("text", "bytes")
                            else "give ids below vocab_size, or a model with a larger "
                            "vocab_size"))


def _token_ids(spec: DataSpec, seed: int) -> np.ndarray:
    """The ``[n_samples, seq_len]`` token ids of a file source (int64), as the job reads them."""
    path = Path(spec.path)
    if spec.source == "text":
        return _windows(np.frombuffer(path.read_bytes(), dtype=np.uint8), spec)
    if spec.source == "bytes":
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, len(mm) - spec.seq_len + 1, size=spec.n_samples)
        return np.stack([np.asarray(mm[s:s + spec.seq_len], dtype=np.int64) for s in starts])
    arr = _token_stream(path)
    return (np.asarray(arr[: spec.n_samples, : spec.seq_len], dtype=np.int64)
            if arr.ndim == 2 else _windows(arr, spec))


def _windows(stream: np.ndarray, spec: DataSpec) -> np.ndarray:
    n, L = spec.n_samples, spec.seq_len
    return np.asarray(stream[: n * L], dtype=np.int64).reshape(n, L)


def load_data(spec: DataSpec, vocab_size: int, seed: int = 0,
              device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The job's samples as a causal-LM batch dict; ValueError if ids exceed ``vocab_size``."""
    if spec.source == "generated":
        return make_batch(spec.n_samples, spec.seq_len, vocab_size, seed=seed, device=device)
    check_data(spec)
    ids = _token_ids(spec, seed)
    _in_vocab(ids, spec, vocab_size)
    input_ids = torch.from_numpy(np.ascontiguousarray(ids)).to(device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "labels": input_ids.clone()}
