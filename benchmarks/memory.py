"""The longest sequence one configuration trains at: flavor, context-parallel degree, AC mode.

    python -m benchmarks.memory --flavor 0.8B --cp 1 --ac full \\
        --out docs/results/memory_0.8b_cp1_full.json

Search: from --start, double while a trial fits (up to --limit), then bisect between the
longest fit and the shortest out-of-memory length down to --granularity tokens (if --start
does not fit, halve first). A trial is --warmup + --steps real training steps (packed
documents, compiled blocks, bf16 compute, chunked loss, AdamW), the step of
benchmarks.throughput; it fits when every step runs. Reported at the longest fit: peak memory
and tokens/s per GPU over the --steps timed steps (median), and every step's loss.

Each trial runs in a fresh `torchrun --nproc_per_node <cp>`, for three reasons:
- An out-of-memory error on one cp rank mid-step leaves the other rank inside an all-to-all
  that will never complete (collectives match by order), so no in-process agreement can
  recover it; ending the processes does. (Within a trial the ranks still agree on an OOM
  they both reach, through an all-reduced flag.)
- A clean allocator per trial: whether a length fits must not depend on what a failed larger
  trial left behind, and peak statistics start from zero.
- Compiled graphs do not pile up across lengths (Dynamo's recompile limit, shape
  specialisation).
The cost is startup and compilation per trial (tens of seconds once Triton's and Inductor's
on-disk caches are warm on the machine). The JSON is rewritten after every trial;
`--resume` reuses the trials the file holds and `--time-budget-s` stops before a trial that
would overrun, so a search longer than one command's time limit continues on the next run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import records

MODULE = "benchmarks.memory"
LOG_ROOT = records.REPO_ROOT / "outputs" / "benchmarks" / "memory_logs"


class SearchStopped(Exception):
    """The search cannot go on in this run: time budget spent, or a trial failed."""


def find_longest(
    fits: Callable[[int], bool], start: int, limit: int, granularity: int
) -> tuple[int | None, int | None]:
    """(longest length that fits, shortest that does not) found with `fits`, assumed monotone.

    Lengths are multiples of `granularity`; `start` and `limit` must be too. A None first
    value: not even `granularity` fits; a None second value: `limit` fits.
    """
    fit = oom = None
    length = start
    while fit is None:  # down from start until a length fits
        if fits(length):
            fit = length
        elif length <= granularity:
            return None, length
        else:
            oom = length
            length = max(granularity, length // 2 // granularity * granularity)
    while oom is None and fit < limit:  # up, doubling
        length = min(2 * fit, limit)
        if fits(length):
            fit = length
        else:
            oom = length
    while oom is not None and oom - fit > granularity:  # bisect
        length = fit + (oom - fit) // 2 // granularity * granularity
        if fits(length):
            fit = length
        else:
            oom = length
    return fit, oom


# ---------------------------------------------------------------------------------------------
# The search (parent process)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--flavor", default="0.8B")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel degree = processes")
    parser.add_argument("--ac", default="full", help='none, full, "selective:op", ...')
    parser.add_argument("--start", type=int, default=32768)
    parser.add_argument("--limit", type=int, default=2**21, help="longest length tried")
    parser.add_argument("--granularity", type=int, default=16384)
    parser.add_argument("--out", type=Path, help="JSON file to write (the search)")
    parser.add_argument("--resume", action="store_true", help="reuse the trials --out holds")
    parser.add_argument("--time-budget-s", type=float, default=None)
    parser.add_argument("--trial-timeout-s", type=float, default=900)
    parser.add_argument(
        "--log-dir",
        type=Path,
        help=f"trial logs (default: {LOG_ROOT.relative_to(records.REPO_ROOT)}/<out name>)",
    )
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)  # a trial's length
    parser.add_argument("--trial-out", type=Path, help=argparse.SUPPRESS)  # set: be a trial
    records.add_training_arguments(parser, steps=4, warmup=1)
    # A rank left waiting in a collective by another rank's OOM gives up after this long.
    parser.set_defaults(pg_timeout_s=300)
    args = parser.parse_args(argv)
    if args.trial_out is None:
        _check_search_args(parser, args)
    return args


def _check_search_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.out is None:
        parser.error("--out is required")
    if args.granularity % args.cp:
        parser.error(f"--granularity {args.granularity} must be a multiple of --cp {args.cp}")
    for name in ("start", "limit"):
        if getattr(args, name) % args.granularity:
            parser.error(f"--{name} must be a multiple of --granularity {args.granularity}")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step compiles)")


class Search:
    """Trials run so far (this run's and, with --resume, the file's) and the output file."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.monotonic()
        self.options = _search_options(args)
        previous = records.read_json(args.out) if args.resume else None
        if previous is not None and previous.get("options") != self.options:
            raise SystemExit(
                f"--resume: {args.out} holds a search with other options "
                f"({previous.get('options')}); use another --out or drop --resume"
            )
        self.data = previous or {"kind": "memory", "options": self.options, "trials": []}
        # A failed trial (a timeout, a crash) is tried again; fits and OOMs are kept.
        self.data["trials"] = [t for t in self.data["trials"] if t["status"] in ("ok", "oom")]
        records.add_command(self.data, records.command_line(MODULE, 1))

    def fits(self, seq_len: int) -> bool:
        trial = next((t for t in self.data["trials"] if t["seq_len"] == seq_len), None)
        if trial is None:
            self._check_time()
            trial = run_trial_process(self.args, seq_len)
            environment = trial.pop("environment", None)
            if environment and not self.data.get("environment"):
                self.data["environment"] = environment
            self.data["trials"].append(trial)
            self.save()
            _report_trial(trial)
        if trial["status"] not in ("ok", "oom"):
            raise SearchStopped(f"the trial at {seq_len} failed; see {trial.get('log')}")
        return trial["status"] == "ok"

    def _check_time(self) -> None:
        budget = self.args.time_budget_s
        if budget is None:
            return
        longest = max((t.get("seconds", 0) for t in self.data["trials"]), default=0)
        if time.monotonic() - self.started + longest > budget:
            raise SearchStopped("time budget spent; rerun the same command with --resume")

    def save(self) -> None:
        self.data["trials"].sort(key=lambda t: t["seq_len"])
        records.write_json(self.args.out, self.data)


def _search_options(args: argparse.Namespace) -> dict:
    keys = ("flavor", "cp", "ac", "start", "limit", "granularity", "warmup", "steps")
    keys += ("config", "compile", "overrides")
    return {key: getattr(args, key) for key in keys}


def _report_trial(trial: dict) -> None:
    peak = trial.get("peak_reserved_gib")
    speed = trial.get("tokens_per_s_per_gpu")
    print(
        f"[memory] seq_len {trial['seq_len']:>8}: {trial['status']:>5}"
        + (f", peak {peak} GiB, {speed} tokens/s/GPU" if peak is not None else "")
        + f" ({trial.get('seconds', 0):.0f} s)",
        flush=True,
    )


def run_trial_process(args: argparse.Namespace, seq_len: int) -> dict:
    """One trial in a fresh torchrun; its record, with status "error" if it neither fitted
    nor ran out of memory."""
    log_dir = (args.log_dir or LOG_ROOT / args.out.stem).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    trial_out, log = log_dir / f"seq{seq_len}.json", log_dir / f"seq{seq_len}.log"
    trial_out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(args.cp), "-m", MODULE]
    command += ["--trial-out", str(trial_out), "--seq-len", str(seq_len)]
    command += _forwarded_arguments(args)
    start = time.monotonic()
    timed_out = _run_logged(command, log, args.trial_timeout_s)
    record = records.read_json(trial_out)
    if record is None:
        text = log.read_text(errors="replace")
        oom = any(message in text for message in records.OOM_MESSAGES)
        record = {
            "seq_len": seq_len,
            "status": "oom" if oom else "error",
            "error": "timed out" if timed_out else _tail(text),
            "detected_from_log": True,
        }
    record["seconds"] = round(time.monotonic() - start, 1)
    record["log"] = str(
        log.relative_to(records.REPO_ROOT) if log.is_relative_to(records.REPO_ROOT) else log
    )
    return record


def _forwarded_arguments(args: argparse.Namespace) -> list[str]:
    forwarded = ["--flavor", args.flavor, "--cp", str(args.cp), "--ac", args.ac]
    forwarded += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    forwarded += ["--compile", args.compile] + (["--config", args.config] if args.config else [])
    forwarded += ["--pg-timeout-s", str(args.pg_timeout_s)]
    for override in args.overrides:
        forwarded += ["--set", override]
    return forwarded


def _run_logged(command: list[str], log: Path, timeout_s: float) -> bool:
    """Run `command` with its output in `log`; kill its whole process group on timeout.
    True if it timed out."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=records.REPO_ROOT,
            start_new_session=True,  # torchrun and its workers: one group to kill
        )
        try:
            process.wait(timeout=timeout_s)
            return False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return True


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def search(args: argparse.Namespace) -> dict:
    state = Search(args)
    complete, stopped = True, None
    try:
        longest, first_oom = find_longest(state.fits, args.start, args.limit, args.granularity)
    except SearchStopped as reason:
        complete, stopped = False, str(reason)
        longest, first_oom = _bounds(state.data["trials"])
    state.data["result"] = _result(state.data["trials"], longest, first_oom, complete, stopped)
    state.save()
    _print_result(state.data, args.out)
    return state.data


def _bounds(trials: list[dict]) -> tuple[int | None, int | None]:
    fits = [t["seq_len"] for t in trials if t["status"] == "ok"]
    ooms = [t["seq_len"] for t in trials if t["status"] == "oom"]
    return max(fits, default=None), min(ooms, default=None)


def _result(trials, longest, first_oom, complete: bool, stopped: str | None) -> dict:
    result = {"longest_fit": longest, "first_oom": first_oom, "complete": complete}
    if stopped:
        result["stopped"] = stopped
    best = next((t for t in trials if t["seq_len"] == longest), None)
    if best is not None:
        for key in ("peak_reserved_gib", "peak_active_gib", "tokens_per_s_per_gpu", "losses"):
            result[key] = best.get(key)
    return result


def _print_result(data: dict, out: Path) -> None:
    options, result = data["options"], data["result"]
    print(
        f"\n{options['flavor']} cp={options['cp']} ac={options['ac']}: longest fit "
        f"{result['longest_fit']} tokens (first OOM: {result['first_oom']}), "
        f"peak {result.get('peak_reserved_gib')} GiB, "
        f"{result.get('tokens_per_s_per_gpu')} tokens/s/GPU"
        + ("" if result["complete"] else f" -- incomplete: {result['stopped']}")
    )
    print(f"wrote {out}")


# ---------------------------------------------------------------------------------------------
# One trial (inside torchrun)


def run_trial(args: argparse.Namespace) -> None:
    from benchmarks import common

    rt = common.init_runtime(args.pg_timeout_s)
    finished = False
    try:
        run = common.RunConfig(args.flavor, args.seq_len, args.cp, args.ac)
        opts = common.options_from_args(args)
        record = {"seq_len": args.seq_len, **_train(run, opts, rt)}
        if rt.rank == 0:
            record["environment"] = common.environment(rt, MODULE)
            records.write_json(args.trial_out, record)
        finished = True
    finally:
        rt.leave(finished)


def _train(run, opts, rt) -> dict:
    from benchmarks import common

    def work() -> dict:
        trainer = common.build_trainer(run, opts, rt)
        seconds, _, losses = common.trained(rt, trainer)
        step_time = common.median(seconds)
        tokens = trainer.tokens_per_step()
        return {
            "step_time_s": step_time,
            "tokens_per_s_per_gpu": round(tokens / step_time / rt.world_size, 1),
            **rt.peak_memory_gib(),
            "losses": common.global_losses(rt, losses),
            "trainer_arguments": common.trainer_arguments(run, opts),
        }

    return common.guarded(rt, work)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.trial_out is not None:
        run_trial(args)
    else:
        search(args)


if __name__ == "__main__":
    from benchmarks import common

    common.run_as_command(main)
