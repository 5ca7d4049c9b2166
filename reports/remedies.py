"""The remedies table: what :func:`~oomguard.engine.core.execute.priced.choose_remedy` measured
(its record, :meth:`~oomguard.engine.core.execute.priced.RemedyChoice.to_dict`), as text cells
for the command line and as a Markdown section for ``report.md``; ``report.json`` holds the
record itself. Bytes in binary units, rates in samples (rows) per second."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.engine.util.units import fmt_bytes

HEADER = ["configuration", "micro-batch", "peak", "samples/s", "status"]


def remedy_rows(record: Mapping[str, Any]) -> list[list[str]]:
    """The record's table as text cells, :data:`HEADER` first: the micro-batch with the
    number of micro-batches per optimizer step where there are several."""
    out = [list(HEADER)]
    for row in record["table"]:
        micro = "-" if row["micro_batch"] is None else str(row["micro_batch"])
        if row["steps"] and row["steps"] > 1:
            micro += f" x {row['steps']}"
        rate = row["samples_per_second"]
        out.append([row["configuration"], micro, fmt_bytes(row["peak_bytes"]),
                    "-" if rate is None else f"{rate:,.1f}",
                    row["status"] + (f": {row['why']}" if row["why"] else "")])
    return out


def chosen_line(record: Mapping[str, Any]) -> str:
    """One sentence: the configuration chosen, its micro-batch and its speed against
    accumulation's."""
    speedup = record.get("speedup_over_accumulate")
    over = (f", {speedup:.2f}x the samples per second of accumulation"
            if speedup and record["chosen"] != "accumulate" else "")
    return (f"{record['rows']} rows per optimizer step: {record['chosen']} at micro-batch "
            f"{record['micro_batch']}{over}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def remedies_section(record: Mapping[str, Any] | None) -> list[str]:
    """``report.md``'s section for a priced record (empty without one)."""
    if not record:
        return []
    rows = remedy_rows(record)
    confirm = record.get("confirmation") or {}
    confirmed = (f"its confirming step ran (peak {fmt_bytes(confirm.get('peak_bytes'))}"
                 + ("" if confirm.get("within_limit") is not False
                    else ", above its recommendation's limit") + ")"
                 if confirm.get("ok") else "no confirming step ran")
    per_step = ("one optimizer step of the effective batch: every micro-batch, then the "
                "optimizer" if record.get("keeps_rows", True)
                else "one call at the micro-batch (a smaller batch, not accumulated)")
    return ["## Remedies Priced by Speed",
            f"**Use {_cell(chosen_line(record))}**; {confirmed}.", "",
            "| " + " | ".join(h.capitalize() for h in rows[0]) + " |",
            "|" + "|".join("---" for _ in rows[0]) + "|",
            *("| " + " | ".join(_cell(c) for c in r) + " |" for r in rows[1:]), "",
            "Each configuration's micro-batch is the recommendation of its own search (in-process "
            "trials that restore the model and optimizer, under the same limit and margin as "
            f"above). Its samples per second and peak are measured over {per_step}, timed as a "
            "trial's second step, in rounds that take the configurations in turn; the fastest "
            "round counts. The fastest configuration is chosen and confirmed by one more real "
            f"step. Priced in {record.get('seconds', 0):.1f} s."]
