"""The GPU checks of issue #28 in one bounded run: the CUDA tests, the outer step's GPU<->host copies, worker
throughput while averaging, and the memory of two nodes at 100M and 1B parameters.

A GPU host is lent for minutes, not hours, so every step runs under its own time limit, in the order of
what matters most, and `DIR/gpu.json` is rewritten after each one: a step that fails or runs out of time
leaves the others' figures (and its own error) behind.

    python bench/gpu.py --out DIR                     # on a GPU host (`make bench-gpu`): every step
    python bench/gpu.py --out DIR --steps env,tests   # some of them
    python bench/gpu.py --write-docs --from DIR       # the `## On a GPU` and `## Memory on a GPU` sections
                                                      # of docs/benchmarks.md from such a run's files

Steps:
- env: torch, CUDA, the GPU (nvidia-smi), host memory, /dev/shm and disk.
- tests: `tests/test_gpu.py` (its `cuda` variants: a trainer in fp32, bf16 and fp16, two real daemons on
  CUDA that average, resume and export) and the fast tests of every module that builds a trainer, with
  `train.device = auto`, which is CUDA there: what passes on the CPU and fails on CUDA is a defect.
- copies: in-process, one trainer of the throughput model on CUDA: the time of an inner step beside the
  outer step's copies (gathering theta from the GPU at publish, the rebase that writes it back), pageable
  host memory as the worker uses it, and pinned for comparison.
- throughput: bench/sync.py part 4 on the GPU (two daemons on one GPU, unpinned, 100M parameters): samples/s
  alone, averaging, alone again.
- memory: bench/memory.py --device cuda at 100M and 1B.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from node.bridge.exchange import ExchangeOutcome  # noqa: E402
from starling_testing.report import replace_section  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## On a GPU"
STEPS = ("env", "tests", "copies", "memory", "throughput")  # in this order: what the issue needs most first
LIMITS_S = {"env": 30, "tests": 170, "copies": 100, "memory": 270, "throughput": 290}

# Every module that builds a trainer: their fast tests run with train.device = auto (CUDA on a GPU host).
TRAINER_TESTS = ["tests/test_worker.py", "tests/test_export.py", "tests/test_compression.py", "tests/test_catchup.py",
                 "tests/test_task_api.py", "tests/test_outer.py", "tests/test_checkpoint.py", "tests/test_hf_task.py"]

# The throughput model: the default task at about 100M parameters, batch 16 x 128 bytes, H = 50.
THROUGHPUT_SETS = {"train.d_model": 1024, "train.n_layers": 8, "train.n_heads": 16, "train.seq_len": 128,
                   "train.batch_size": 16, "train.inner_steps": 50, "train.data_bytes": 2_000_000,
                   "train.device": "cuda"}
THROUGHPUT_WINDOW_S = 20.0
MEMORY_SIZES = "100M,1B"
# The throughput step's phases to run (--phases): all of them by default.
ONLY_PHASES: list[str] = []

# --dry-run: the same steps on the CPU at toy sizes, to try this script without a GPU before a lease.
DRY_RUN = {"throughput": {**THROUGHPUT_SETS, "train.d_model": 64, "train.n_layers": 1, "train.n_heads": 2,
                          "train.seq_len": 32, "train.batch_size": 4, "train.inner_steps": 5,
                          "train.data_bytes": 300_000, "train.device": "cpu", "train.outer_threads": 2},
           "window_s": 5.0, "memory_sizes": "10M"}


def sets(options: dict[str, Any]) -> list[str]:
    return [a for k, v in options.items() for a in ("--set", f"{k}={v}")]


def run(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """A command's exit status (None when it ran out of time) and its output's last 6000 characters.

    The command runs in its own process group, and the whole group is killed when its time is up: a bench
    killed alone would leave its daemons and workers training on the GPU under the next step (and their
    shared-memory slots, swept afterwards, in RAM)."""
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        except OSError as e:  # no such program
            return 127, str(e)
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if code is None:  # the killed daemons' slots, once every process of the group is gone
                from node.bridge.shm import sweep_orphans

                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    try:
                        os.killpg(proc.pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.2)
                sweep_orphans()
        log.seek(0)
        return code, log.read()[-6000:]


# --- the steps --------------------------------------------------------------------------------------------


def step_env(_out: Path, _limit: float) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                            "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
    code, smi = run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], 20)
    info["nvidia_smi"] = smi.strip() if code == 0 else f"unavailable: {smi.strip()[:200]}"
    info["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    for name, path in (("shm_free_gib", "/dev/shm"), ("disk_free_gib", tempfile.gettempdir())):
        info[name] = round(shutil.disk_usage(path).free / 2**30, 1)
    return info


def step_tests(out: Path, limit: float) -> dict[str, Any]:
    """tests/test_gpu.py's `gpu` variants, then the trainer modules' fast tests (on CUDA through `auto`)."""
    result: dict[str, Any] = {}
    began = time.monotonic()
    for name, selection in (("gpu", ["tests/test_gpu.py", "-m", "gpu"]),
                            ("trainer_modules", [*TRAINER_TESTS, "-m", "not slow and not lab and not long"])):
        left = limit - (time.monotonic() - began)
        code, text = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--timeout", "150",
                          "--junitxml", str(out / f"tests-{name}.xml"), *selection], left)
        summary = next((line for line in reversed(text.splitlines())
                        if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)), "")
        junit = out / f"tests-{name}.xml"
        result[name] = {"exit": code, "summary": summary.strip("= ") or "ran out of time", "tail": text[-2500:],
                        "junit": junit.read_text() if junit.exists() else None}
    return result


def step_copies(out: Path, limit: float) -> dict[str, Any]:
    dry = ["--dry-run"] if THROUGHPUT_SETS["train.device"] == "cpu" else []
    code, text = run([sys.executable, str(Path(__file__)), *dry, "--copies-json", str(out / "copies.json")], limit)
    if code != 0:
        return {"exit": code, "tail": text[-3000:]}
    return json.loads((out / "copies.json").read_text())


def step_throughput(_out: Path, limit: float) -> dict[str, Any]:
    import sync as bench_sync

    model = sets(THROUGHPUT_SETS)
    root = Path(tempfile.mkdtemp(prefix="starling-bench-gpu-"))
    phases = []
    began = time.monotonic()
    try:
        # The outer step's host work on `train.outer_threads` (auto) and, for comparison in the same run, on the
        # one thread it had before (`train.outer_threads = 1`).
        for name, averaging, extra in (("alone", False, []), ("averaging", True, []),
                                       ("averaging, outer step on 1 thread", True, ["--set", "train.outer_threads=1"]),
                                       ("alone again", False, [])):
            if ONLY_PHASES and name not in ONLY_PHASES:
                continue
            if time.monotonic() - began > limit - 40:
                phases.append({"name": name, "error": "not run: out of time"})
                continue
            tag = re.sub(r"[^a-z0-9]+", "-", name)
            ph = bench_sync.run_phase(tag, root, [*model, *extra], [None, None], averaging=averaging,
                                      window_s=THROUGHPUT_WINDOW_S, batch_size=THROUGHPUT_SETS["train.batch_size"],
                                      warmup_timeout=90)
            phases.append({"name": name, "averaging": averaging, "samples_per_s": ph.samples_per_s,
                           "reported_samples_per_s": ph.reported_samples_per_s, "sets": extra[1::2],
                           "averaged_rounds": ph.averaged_rounds, "solo_rounds": ph.solo_rounds})
            print(f"  throughput {name}: {ph.samples_per_s}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {"model": THROUGHPUT_SETS, "window_s": THROUGHPUT_WINDOW_S, "phases": phases}
    alone = [statistics.mean(p["samples_per_s"]) for p in phases if "samples_per_s" in p and not p["averaging"]]
    syncing = [statistics.mean(p["samples_per_s"]) for p in phases if "samples_per_s" in p and p["averaging"]]
    if alone and syncing:
        result["ratio"] = syncing[0] / max(alone)
        if len(syncing) > 1:
            result["ratio_one_thread"] = syncing[1] / max(alone)
    return result


def step_memory(out: Path, limit: float) -> dict[str, Any]:
    device = THROUGHPUT_SETS["train.device"]
    code, text = run([sys.executable, "bench/memory.py", "--device", str(device), "--sizes", MEMORY_SIZES, "--json",
                      str(out / "memory.json")], limit)
    rows = json.loads((out / "memory.json").read_text()) if (out / "memory.json").exists() else []
    return {"exit": code, "sizes": [r["size"] for r in rows], "tail": text[-3000:]}


STEP_FUNCS: dict[str, Callable[[Path, float], dict[str, Any]]] = {
    "env": step_env, "tests": step_tests, "copies": step_copies, "throughput": step_throughput, "memory": step_memory,
}


# --- copies: in-process timing (run as its own process by step_copies) ---------------------------------------


def measure_copies(path: Path) -> None:
    """Median seconds of an inner step and of the outer step's copies, for one trainer on CUDA."""
    import torch

    from node.config.train import TrainConfig
    from node.worker.trainer import Trainer, outer_threads

    model = {k.removeprefix("train."): v for k, v in THROUGHPUT_SETS.items()}
    cfg = TrainConfig(**model, warmup=2, eval_batches=1)  # type: ignore[arg-type]
    torch.set_num_threads(cfg.threads)  # as the worker does (node/worker/trainer.py): its host-side work runs on these
    with tempfile.TemporaryDirectory() as home:
        tr = Trainer(cfg, Path(home), "peer-a")

        sync = torch.cuda.synchronize if tr.device.type == "cuda" else (lambda: None)

        def timed(fn: Callable[[], Any], n: int) -> float:
            times = []
            for _ in range(n):
                sync()
                t = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        for _ in range(5):
            tr.inner_step()  # warm-up: kernels, allocator, data
        inner = timed(tr.inner_step, 20)
        pageable = torch.empty(tr.numel, dtype=torch.float32)
        pinned = torch.empty(tr.numel, dtype=torch.float32, pin_memory=tr.device.type == "cuda")
        gather = timed(lambda: tr.gather_theta(pageable), 5)
        gather_pinned = timed(lambda: tr.gather_theta(pinned), 5)
        slots = (torch.empty(tr.numel), torch.empty(tr.numel))

        def outer_step() -> None:
            while not tr.publish_due():
                tr.inner_step()
            tr.publish(*slots)
            tr.apply_result(ExchangeOutcome(1))

        outer_step()

        def outer_costs(threads: int) -> dict[str, float]:
            """Publish, a solo result and a pair's result with `threads` for the outer step's host work."""
            tr.host_threads = threads
            publish_times, apply_times, group_times = [], [], []
            for _ in range(3):
                while not tr.publish_due():
                    tr.inner_step()
                sync()
                t = time.perf_counter()
                tr.publish(*slots)
                sync()
                publish_times.append(time.perf_counter() - t)
                t = time.perf_counter()
                tr.apply_result(ExchangeOutcome(1))
                sync()
                apply_times.append(time.perf_counter() - t)
            for _ in range(3):
                while not tr.publish_due():
                    tr.inner_step()
                tr.publish(*slots)
                sum_phi, sum_delta = slots[0] * 2, slots[1] * 2
                sync()
                t = time.perf_counter()
                tr.apply_result(ExchangeOutcome(2, partner_samples=tr.published_samples), sum_phi, sum_delta)
                sync()
                group_times.append(time.perf_counter() - t)
            return {"publish_s": statistics.median(publish_times), "apply_solo_s": statistics.median(apply_times),
                    "apply_group_s": statistics.median(group_times)}

        auto = outer_threads(cfg, tr.device)
        by_threads = {str(n): outer_costs(n) for n in dict.fromkeys((1, auto))}
        result = {"params": tr.numel, "precision": tr.precision, "threads": cfg.threads, "outer_threads": auto,
                  "inner_step_s": inner, "gather_theta_pageable_s": gather, "gather_theta_pinned_s": gather_pinned,
                  "by_threads": by_threads, **by_threads[str(auto)], "inner_steps_per_outer": cfg.inner_steps}
    path.write_text(json.dumps(result, indent=1))


# --- the report ---------------------------------------------------------------------------------------------


def render_copies(copies: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """The copies table: one column per count of host threads the outer step was timed with."""
    h = copies["inner_steps_per_outer"]
    inner = copies["inner_step_s"]
    by = copies.get("by_threads") or {str(copies.get("threads", 1)): copies}
    counts = sorted(by, key=int)
    lines = ["### The outer step's copies between the GPU and the host", "",
             f"One trainer in-process, inner steps on torch threads = {copies.get('threads', 'default')} (the worker's "
             f"`train.threads`), {copies['params']:,} parameters ({copies['precision']} autocast, batch "
             f"{THROUGHPUT_SETS['train.batch_size']} x {THROUGHPUT_SETS['train.seq_len']} bytes), medians with the "
             "GPU synchronised around each; the outer step's host work (publish, apply) timed with each count of "
             f"threads (`train.outer_threads`; auto here: {copies.get('outer_threads', '?')}), in one run:", "",
             "| what | " + " | ".join(f"ms, {n} thread{'s' if n != '1' else ''}" for n in counts) + " |",
             "|---|" + "---|" * len(counts),
             f"| one inner step | {inner * 1e3:.1f}" + " |" * len(counts)]
    for key, what in (("gather_theta_pageable_s", "gather theta GPU -> host fp32, pageable host memory"),
                      ("gather_theta_pinned_s", "the same into page-locked memory (the worker's theta at publish)")):
        if key in copies:
            lines.append(f"| {what} | {copies[key] * 1e3:.1f}" + " |" * len(counts))
    for key, what in (("publish_s", "publish (gather theta, phi and Delta into the slots)"),
                      ("apply_solo_s", "apply a solo result (outer step on the host, rebase on the GPU)"),
                      ("apply_group_s", "apply a pair's result (the NoLoCo step, its finite checks, the rebase)")):
        if all(key in by[n] for n in counts):
            lines.append(f"| {what} | " + " | ".join(f"{by[n][key] * 1e3:.1f}" for n in counts) + " |")
    lines.append("")
    for n in counts:
        row = by[n]
        applied = row.get("apply_group_s", row["apply_solo_s"])
        share = (row["publish_s"] + applied) / (h * inner)
        lines.append(f"With H = {h} and {n} thread{'s' if n != '1' else ''}, a publish and applying a pair's result "
                     f"take **{share:.0%}** of the time of an outer step's compute on this model (time in which the "
                     "worker does not train).")
    return [*lines, ""]


def render(results: dict[str, Any], command: str) -> str:
    env = results.get("env", {})
    gpu = env.get("gpu") or env.get("nvidia_smi") or "a GPU"
    lines = [SECTION, "",
             f"`{command}` on one {gpu} ({env.get('gpu_memory_gib', '?')} GiB), {env.get('cpus', '?')} CPU cores, "
             f"{env.get('host_memory_gib', '?')} GiB of host memory; torch {env.get('torch', '?')} (CUDA "
             f"{env.get('cuda', '?')}), Python {env.get('python', '?')}; {results.get('date', '')}, on a "
             "lent machine. The run's files are in bench/gpu_run/ (`python "
             "bench/gpu.py --write-docs --from bench/gpu_run` renders this section from them).", ""]
    lines += [*results.get("notes", []), ""] if results.get("notes") else []
    tests = results.get("tests")
    if tests:
        gpu_tests, modules = tests.get("gpu", {}), tests.get("trainer_modules", {})
        lines += ["### The tests on CUDA", "",
                  f"- `pytest tests/test_gpu.py -m gpu` (a trainer in fp32, bf16 and fp16 on CUDA: trains, "
                  "averages, checkpoints and resumes exactly, CUDA RNG included; two real daemons on CUDA "
                  f"average, resume and export): **{gpu_tests.get('summary') or tests.get('error')}**.",
                  "- The fast tests of every module that builds a trainer "
                  f"({', '.join(t.removeprefix('tests/') for t in TRAINER_TESTS)}), with `train.device = auto`, "
                  f"which is CUDA there: **{modules.get('summary') or tests.get('error')}**.", ""]
        if failed := failures(modules.get("junit")):
            lines += ["  Failed there: " + "; ".join(f"`{name}`" for name in failed) + "."]
        if rerun := results.get("tests_rerun"):
            lines += [f"- Re-run ({rerun['what']}): **{rerun['summary']}**; {rerun['failed']}.", ""]
    copies = results.get("copies")
    if copies and "inner_step_s" in copies:
        lines += render_copies(copies, results)
    thr = results.get("throughput")
    if thr and thr.get("phases"):
        model = thr.get("model", THROUGHPUT_SETS)
        size = f"{copies['params']:,} parameters, " if copies and "params" in copies else ""
        precision = f"{copies['precision']} autocast, " if copies and "precision" in copies else ""
        lines += ["### Worker throughput while averaging, on the GPU", "",
                  f"bench/sync.py part 4's method with two daemons sharing the one GPU, unpinned: the default task "
                  f"at d_model {model['train.d_model']}, {model['train.n_layers']} layers ({size}batch "
                  f"{model['train.batch_size']} x {model['train.seq_len']} bytes), H = {model['train.inner_steps']}, "
                  f"{precision}a {thr['window_s']:.0f} s window per phase after the first outer step (averaging: "
                  "after the first averaged one); samples/s from the workers' step counters. *alone*: each in "
                  "its own swarm, solo outer steps; *averaging*: the two in one swarm.", "",
                  "| phase | samples/s node a | node b | outer steps in the window | status's samples/s (a, b) |",
                  "|---|---|---|---|---|"]
        for ph in thr["phases"]:
            if "samples_per_s" not in ph:
                lines.append(f"| {ph['name']} | - | - | {ph.get('error', '')} | |")
                continue
            steps = (f"{ph['averaged_rounds']} averaged, {ph['solo_rounds']} solo (both nodes)" if ph["averaging"]
                     else "solo")
            a, b = ph["samples_per_s"]
            ra, rb = ph.get("reported_samples_per_s") or (float("nan"), float("nan"))
            lines.append(f"| {ph['name']} | {a:.0f} | {b:.0f} | {steps} | {ra:.0f}, {rb:.0f} |")
        if "ratio" in thr:
            lines += ["", f"**averaging / alone = {thr['ratio']:.3f}** (against the faster alone phase)."]
        if "ratio_one_thread" in thr:
            lines += [f"With the outer step's host work on one thread (`train.outer_threads = 1`, as before), in the "
                      f"same run: **{thr['ratio_one_thread']:.3f}**."]
        lines += [*thr.get("notes", []), ""]
    for name in STEPS:
        if isinstance(results.get(name), dict) and results[name].get("error"):
            lines.append(f"Step `{name}` did not finish: {results[name]['error']}")
    return "\n".join(lines).rstrip() + "\n"


def failures(junit: str | None) -> list[str]:
    """The failed test cases of a JUnit XML file's text."""
    if not junit:
        return []
    import xml.etree.ElementTree as ET

    root = ET.fromstring(junit)
    return [f"{case.get('classname', '').removeprefix('tests.')}::{case.get('name')}" for case in root.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def memory_gpu(src: Path) -> str:
    """The GPU that memory.json's rows were measured on: that of the run whose results hold a `memory` step.

    Why not simply gpu.json's: a lease runs some steps, and a later lease on another kind of GPU may run others
    into the same folder; the memory rows of 2026-11-26 came from an H200 and were labelled with the H100 of the
    later gpu.json (issue #52)."""
    for path in [src / "gpu.json", *sorted(src.glob("gpu-*.json"))]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        gpu = data.get("env", {}).get("nvidia_smi") if isinstance(data, dict) else None
        if isinstance(data, dict) and "memory" in data and gpu:
            return str(gpu)
    return "a GPU the run's files do not name"


def write_docs(src: Path) -> None:
    import memory

    results = json.loads((src / "gpu.json").read_text())
    command = results.get("command", "python bench/gpu.py")
    replace_section(DOCS, SECTION, render(results, command))
    rows_file = src / "memory.json"
    if rows_file.exists():
        rows = memory.load_rows(rows_file)
        if rows:
            mem_command = "python bench/memory.py --device cuda --sizes " + ",".join(r.size for r in rows)
            replace_section(DOCS, memory.GPU_SECTION, memory.render_gpu(rows, mem_command, memory_gpu(src)))
    print(f"written to {DOCS}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="directory for gpu.json and the steps' files")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated: {', '.join(STEPS)}")
    ap.add_argument("--write-docs", action="store_true", help="render docs/benchmarks.md from --from DIR")
    ap.add_argument("--from", dest="src", type=Path, help="a run's --out directory (with --write-docs)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all the steps: each gets the smaller of its own limit and what is left")
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at toy sizes (no GPU needed)")
    ap.add_argument("--phases", default="", help="the throughput step's phases, ';'-separated names (default: all)")
    ap.add_argument("--copies-json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        global THROUGHPUT_WINDOW_S, MEMORY_SIZES
        THROUGHPUT_SETS.update(DRY_RUN["throughput"])  # type: ignore[arg-type]
        THROUGHPUT_WINDOW_S, MEMORY_SIZES = DRY_RUN["window_s"], DRY_RUN["memory_sizes"]  # type: ignore[assignment]
    ONLY_PHASES[:] = [p for p in args.phases.split(";") if p]
    if args.copies_json:
        measure_copies(args.copies_json)
        return 0
    if args.write_docs:
        if args.src is None:
            ap.error("--write-docs needs --from DIR")
        write_docs(args.src)
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    steps = [s for s in args.steps.split(",") if s]
    if unknown := [s for s in steps if s not in STEPS]:
        ap.error(f"--steps: unknown {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": "python bench/gpu.py " + " ".join(argv or sys.argv[1:]),
                               "date": time.strftime("%Y-%m-%d")}
    start = time.monotonic()
    for name in steps:
        began = time.monotonic()
        limit = float(LIMITS_S[name])
        if args.budget is not None:
            limit = min(limit, args.budget - (began - start))
        print(f"[{name}] (limit {limit:.0f} s)", flush=True)
        if limit < 20:
            results[name] = {"error": f"not run: {limit:.0f} s of the budget left"}
            continue
        try:
            results[name] = STEP_FUNCS[name](args.out, limit)
        except Exception as e:  # one step's failure must not cost the others' figures
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["seconds"] = round(time.monotonic() - began, 1)
        print(json.dumps(results[name], indent=1)[:3000], flush=True)
        (args.out / "gpu.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
