"""A job whose disk fills up after its results: ``oomguard run`` keeps the results, says
in one line that the report could not be written, and never prints the path of a
``report.md`` that is not there.

The disk is a real one: a tmpfs of a few MiB (mounting needs root; without it the test is
skipped, and :func:`test_report_write_fails_enospc_fake` stands in, its write failing with
the ``OSError(ENOSPC)`` a full disk raises), filled so that exactly the files written before
the report fit: the space a first run of the same job used up to ``results.json`` is
measured on the same filesystem, then a filler file leaves just that free.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from oomguard.engine.cli.main import main

TINY = ("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32,bos_token_id=0,"
        "eos_token_id=0")
PAGE = os.sysconf("SC_PAGE_SIZE")  # tmpfs allocates whole pages


def _job(folder: Path, out: Path) -> Path:
    path = folder / f"{out.name}.toml"
    path.write_text(f'output = "{out}"\nmodels = ["{TINY}"]\n[data]\nseq_len = 8\n'
                    'n_samples = 2\n[search]\nenabled = false\n[[metrics]]\nname = "loss"\n',
                    encoding="utf-8")
    return path


def _pages(folder: Path, skip: tuple[str, ...] = ()) -> int:
    """Pages the files under ``folder`` take on a tmpfs, those named in ``skip`` left out."""
    return sum(-(-p.stat().st_size // PAGE) for p in folder.rglob("*")
               if p.is_file() and p.name not in skip)


def _free(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def small_disk(tmp_path: Path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the _enospc_fake "
                    "test covers this")
    try:
        yield mnt
    finally:
        # Lazily: the job's FileSink keeps journal.jsonl open in this process (it is
        # closed when collected), which a plain umount reports as "target is busy".
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.slow
def test_a_disk_full_at_the_report_keeps_the_results_and_prints_no_report_path(
        small_disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A first run measures the space the job takes before its report.
    assert main(["run", str(_job(tmp_path, small_disk / "first"))]) == 0
    capsys.readouterr()
    before_report = _pages(small_disk / "first", skip=("report.md", "memory.png"))
    filler = _free(small_disk) - before_report * PAGE
    (small_disk / "filler").write_bytes(b"\0" * filler)
    assert _free(small_disk) == before_report * PAGE

    out = small_disk / "second"
    code = main(["run", str(_job(tmp_path, out))])
    cap = capsys.readouterr()
    assert code == 1
    assert not (out / "report.md").exists()
    assert "report.md" not in cap.out.replace("report.md not written", "")
    assert cap.out.splitlines()[-1] == (f"results: {out}/results.json, report.md not written "
                                        "(see above)")
    assert "could not write the report" in cap.err and "No space left on device" in cap.err
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert results["tasks"]["loss"]["status"] == "ok"  # the results are kept, whole


@pytest.mark.slow
def test_report_write_fails_enospc_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A fake: report.md's write raises what a full disk raises (``OSError(ENOSPC)``), for
    machines where no small filesystem can be mounted."""
    from oomguard.reports import job_report

    real = job_report.atomic_write

    def full(path, content, *args, **kwargs):
        if Path(path).name == "report.md":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, content, *args, **kwargs)

    monkeypatch.setattr(job_report, "atomic_write", full)
    out = tmp_path / "out"
    code = main(["run", str(_job(tmp_path, out))])
    cap = capsys.readouterr()
    assert code == 1 and not (out / "report.md").exists()
    assert cap.out.splitlines()[-1] == (f"results: {out}/results.json, report.md not written "
                                        "(see above)")
    assert "No space left on device" in cap.err
