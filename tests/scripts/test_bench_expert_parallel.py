"""scripts/bench_expert_parallel.py in its CPU mode: the plain layer and its expert-parallel path at E = 1 both
timed (a process group of one, gloo, on a port of the test's own), each row a finite time and its ratio."""
from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

from launch import free_port, python_command

ROOT = Path(__file__).resolve().parents[2]


def test_both_rows_are_timed_with_their_ratio():
    result = subprocess.run([*python_command(), str(ROOT / "scripts" / "bench_expert_parallel.py"), "--device", "cpu",
                             "--batch", "2", "--iters", "2", "--warmup", "1"], capture_output=True, text=True,
                            env={**os.environ, "MASTER_PORT": str(free_port())}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line[:30].strip(): line[30:].split() for line in result.stdout.splitlines()
            if line.startswith(("plain layer", "expert-parallel path"))}
    assert sorted(rows) == ["expert-parallel path, E = 1", "plain layer"]
    assert rows["plain layer"][-1] == "1.00x"
    for ms, _peak, ratio in rows.values():
        assert math.isfinite(float(ms)) and float(ms) > 0 and float(ratio.rstrip("x")) > 0
