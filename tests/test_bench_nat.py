"""bench/nat.py's options and report, without the lab: the runs themselves are benchmark figures
(docs/benchmarks.md "NAT", "NAT with latency")."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAT = ROOT / "bench" / "nat.py"


def _load_nat():  # bench/ is not a package: load bench/nat.py by path
    spec = importlib.util.spec_from_file_location("bench_nat", NAT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_nat"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_bad_latency_options_are_refused_with_a_message_not_a_traceback() -> None:
    for args in (["--rtt-ms", "abc"], ["--rtt-ms", "100,-5"], ["--rtt-ms", "100", "--jitter-ms", "150"],
                 ["--loss", "0.7"]):
        r = subprocess.run([sys.executable, str(NAT), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 2, (args, r.stderr)
        assert "--rtt-ms" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_run_with_latency_writes_its_own_section_with_a_row_per_round_trip(monkeypatch) -> None:
    nat = _load_nat()
    written: list[tuple[str, str]] = []
    monkeypatch.setattr(nat, "replace_section", lambda path, heading, body: written.append((heading, body)))
    row = {"listening_s": 3.0, "connected_s": 6.0, "direct_s": 9.0, "direct_max_s": 11.0, "trials": 3,
           "jitter_ms": 10.0, "loss": 0.0}
    nat.write_docs("python bench/nat.py --parts 1 --rtt-ms 100,300", "load 1.0",
                   [{**row, "rtt_ms": 100.0}, {**row, "rtt_ms": 300.0, "direct_s": 12.5}], None)
    (heading, body), = written
    assert heading == "## NAT with latency" and body.startswith(heading)
    assert "| 100 +-10 ms | 3.0 | 6.0 | 9.0 | 11.0 |" in body and "| 300 +-10 ms | 3.0 | 6.0 | 12.5 | 11.0 |" in body
    written.clear()
    nat.write_docs("python bench/nat.py --parts 1", "load 1.0", [{**row, "rtt_ms": 0.0, "jitter_ms": 0.0}], None)
    assert written[0][0] == "## NAT" and "| none added | 3.0 |" in written[0][1]
