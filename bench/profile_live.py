"""CPU per change of the live pipeline (bench/run.py's ddb2bt contestant), total
and by stage, on a busy machine: CPU time, not wall time, is what is compared.

    .venv/bin/python bench/profile_live.py                       # totals, 3 runs of 20,000 changes
    .venv/bin/python bench/profile_live.py --profile /tmp/live.prof --top 40
    .venv/bin/python bench/profile_live.py --unpaced             # the pacer off, as bench/run.py's unpaced row

Totals: ``time.process_time()`` (every thread of this process; the emulator's CPU
is not counted) from the job's start to the last change applied, per change, as
bench/run.py counts it (``--unpaced``: its unpaced row). Stages: the CPU
time of the thread running each stage's entry points (wrapped, a few clock reads
per page of 1,000 changes):

  read      the source SDF's per-round work: ``batch_records(read_round(...))``
            (GetRecords on the fake client, shown separately, decoding, claims,
            read metrics, batching into RecordBatches)
  map       ``_MapChangesFn.process`` (the mapping engine)
  sink      ``_WriteToBigtableFn`` process/finish_bundle, and ``BatchingWriter._commit``
            on the write thread (coalescing, requests, MutateRows, checkpoints, metrics)
  runner + rest   the remainder: Beam's FnApiRunner, gRPC's own I/O threads, the harness

Run the baseline the same way with another checkout's packages first on the
path (PYTHONPATH=<dir holding ddb2bt/{pipeline,transforms,examples}>); the line
"code under test" says which one ran. With ``--profile`` one more run is made
under cProfile (wall-clock timer) in every Python thread, for the top entries.
Profiled figures are inflated by cProfile's own cost; compare stages with each
other and runs with runs, not with the unprofiled totals.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import LAST_LIVE_RUN, MAPPING, fresh_table, run_ddb2bt, stream_records, unpaced  # noqa: E402
from ddb2bt.pipeline.local.local_stack import LocalStack  # noqa: E402

class StageClock:
    """CPU time (of the calling thread) inside each stage's entry points, kept by
    wrapping them: a few clock reads per page of 1,000 changes, so the stages can
    be measured in ordinary (unprofiled) runs. The sink's batches written on its
    own thread are counted there (``sink_thread``)."""

    def __init__(self) -> None:
        self.cpu: dict = {}

    def _add(self, stage: str, seconds: float) -> None:
        self.cpu[stage] = self.cpu.get(stage, 0.0) + seconds

    def gen(self, stage: str, fn):
        def wrapped(*args, **kwargs):
            it = fn(*args, **kwargs)
            while True:
                t0 = time.thread_time()
                try:
                    element = next(it)
                except StopIteration as stop:
                    self._add(stage, time.thread_time() - t0)
                    return stop.value
                self._add(stage, time.thread_time() - t0)
                yield element
        return wrapped

    def call(self, stage: str, fn, only_off_main: bool = False):
        def wrapped(*args, **kwargs):
            if only_off_main and threading.current_thread() is threading.main_thread():
                return fn(*args, **kwargs)
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(stage, time.thread_time() - t0)
        return wrapped

    def install(self) -> None:
        from ddb2bt.pipeline.sink import sink
        from ddb2bt.pipeline.source import stream_sdf
        from ddb2bt.pipeline.testing import fakes
        from ddb2bt.transforms import dofns

        # read: everything the SDF does per round happens inside batch_records(read_round(...))
        stream_sdf.batch_records = self.gen("read", stream_sdf.batch_records)
        fakes.FakeStreamsClient.get_records = self.call("read: fake client (harness)",
                                                        fakes.FakeStreamsClient.get_records)
        map_process = dofns._MapChangesFn.process

        def process(self_, element):  # same signature: Beam inspects it
            return clock.gen("map", map_process)(self_, element)

        clock = self
        dofns._MapChangesFn.process = process
        sink_process, sink_finish = sink._WriteToBigtableFn.process, sink._WriteToBigtableFn.finish_bundle

        def sink_process_w(self_, element):
            return clock.gen("sink", sink_process)(self_, element)

        def finish_bundle(self_):
            return clock.gen("sink", sink_finish)(self_)

        sink._WriteToBigtableFn.process = sink_process_w
        sink._WriteToBigtableFn.finish_bundle = finish_bundle
        sink.BatchingWriter._commit = self.call("sink: write thread", sink.BatchingWriter._commit,
                                                only_off_main=True)


class ThreadProfiles:
    """cProfile in the calling thread and in every thread started while active."""

    def __init__(self) -> None:
        self.profiles: list = []
        self._lock = threading.Lock()

    def _new(self) -> cProfile.Profile:
        prof = cProfile.Profile()  # wall timer: CPU-time timers cost a system call per event
        with self._lock:
            self.profiles.append(prof)
        return prof

    def _hook(self, frame, event, arg):  # the first event of a new thread switches to cProfile
        self._new().enable()

    def __enter__(self):
        threading.setprofile(self._hook)
        self._main = self._new()
        self._main.enable()
        return self

    def __exit__(self, *exc):
        self._main.disable()
        threading.setprofile(None)

    def stats(self) -> pstats.Stats:
        stats = None
        for prof in self.profiles:
            prof.create_stats()
            if not prof.stats:
                continue
            if stats is None:
                stats = pstats.Stats(prof, stream=io.StringIO())
            else:
                stats.add(prof)
        return stats


def one_run(n: int, project: str, instance: str, records: list, clock: StageClock) -> tuple:
    table = fresh_table(project, instance)
    gc.collect()
    clock.cpu = {}
    wall = run_ddb2bt(records, project, instance, table)
    # The job's start to the last change applied (bench/run.py's LAST_LIVE_RUN): not
    # the harness's filling of the fake stream, nor the idle wait that ends the run.
    return LAST_LIVE_RUN["cpu_s"], wall, dict(clock.cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3, help="measured runs (default 3)")
    parser.add_argument("--profile", help="also make one cProfile run and write its stats here")
    parser.add_argument("--top", type=int, default=30, help="profile entries shown (by own time)")
    parser.add_argument("--unpaced", action="store_true",
                        help="take the pacer away (the fake stream is not AWS), as bench/run.py's unpaced row")
    args = parser.parse_args()
    n = args.changes
    project, instance = MAPPING.target.project, MAPPING.target.instance
    clock = StageClock()
    clock.install()
    import ddb2bt.pipeline.sink.sink as sink_module

    print(f"code under test: {Path(sink_module.__file__).resolve().parent.parent.parent}")
    with LocalStack() as stack, unpaced() if args.unpaced else contextlib.nullcontext():
        print(f"pacing: {'off (unpaced)' if args.unpaced else 'on (5 GetRecords/s per shard)'}")
        stack.apply_env()
        records = stream_records(n)
        one_run(min(n, 2000), project, instance, records[:2000], clock)  # warm-up: imports, channels
        runs = []
        for i in range(args.repeat):
            cpu, wall, stages = one_run(n, project, instance, records, clock)
            stages["TOTAL (process CPU)"] = cpu
            accounted = sum(v for k, v in stages.items() if ":" not in k and not k.startswith("TOTAL")) + \
                stages.get("sink: write thread", 0.0)
            stages["runner + rest"] = cpu - accounted
            runs.append(stages)
            print(f"run {i + 1}: {cpu / n * 1e6:.1f} us CPU per change ({n / wall:,.0f} changes/s wall; "
                  "busy machine: not comparable)", flush=True)
        print(f"\nus CPU per change, median of {len(runs)} runs of {n:,} changes (min in brackets):")
        for key in sorted({k for r in runs for k in r}):
            values = sorted(r.get(key, 0.0) / n * 1e6 for r in runs)
            print(f"  {key:<32} {values[len(values) // 2]:7.1f}  ({values[0]:.1f})")
        if args.profile:
            table = fresh_table(project, instance)
            with ThreadProfiles() as tp:
                run_ddb2bt(records, project, instance, table)
            stats = tp.stats()
            stats.dump_stats(args.profile)
            out = io.StringIO()
            stats.stream = out
            stats.sort_stats("tottime").print_stats(args.top)
            print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
