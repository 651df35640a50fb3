"""`make test`: the whole suite as two pytest processes side by side, `-m ray` and `-m "not ray"`.

Why: on the 2-core CI machine a serial run keeps about one core busy. The Ray tests spend much
of their time waiting (a head starting, a replica loading, a proxy becoming ready, a stream
being cancelled), while the rest (engine, kernels, real-model exactness) are compute. Run side
by side, each fills the other's gaps. The Ray tests stay in one process, in their order, so one
Ray cluster at a time exists and the shared cluster is reused as before (tests/conftest.py marks
every test that uses Ray `ray`). Shared first-use work (the model conversion, the kernel build)
is guarded by file locks, so whichever part needs it first does it and the other waits.

Each part's output goes to a file and is printed whole when that part ends, the Ray part's
first if both end together; the exit status is the first non-zero one. Arguments are passed to
both pytest runs (and PYTEST_ADDOPTS reaches both).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = {"ray": ["-m", "ray"], "rest": ["-m", "not ray"]}


def main(argv: list[str]) -> int:
    start = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="kvserve-tests-"))
    running: dict[str, tuple[subprocess.Popen, Path]] = {}
    for name, select in PARTS.items():
        log = logs / f"{name}.log"
        with log.open("wb") as out:
            running[name] = (subprocess.Popen(
                [sys.executable, "-m", "pytest", *select, *argv],
                stdout=out, stderr=subprocess.STDOUT), log)
    print(f"tests: {' and '.join(f'-m {s[-1]!r}' for s in PARTS.values())} side by side; "
          f"logs in {logs}", flush=True)
    status = 0
    while running:
        for name, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            minutes = (time.monotonic() - start) / 60
            print(f"\n===== part {name!r}: exit {proc.returncode} after {minutes:.1f} min "
                  f"=====", flush=True)
            sys.stdout.write(log.read_text(errors="replace"))
            sys.stdout.flush()
            # 5: no tests collected (a selection that is empty in a partial run) is not a failure
            if proc.returncode not in (0, 5) and status == 0:
                status = proc.returncode
        time.sleep(0.5)
    print(f"\n===== all parts done in {(time.monotonic() - start) / 60:.1f} min, exit {status}",
          flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
