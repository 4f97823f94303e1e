"""The ``ddb2bt recover`` command (docs/recover.md): holds the tail's lease while it
writes, shows progress, releases the lease at the end. The CLI (``pipeline/app/cli.py``)
only parses and calls these; what they print and return is the command's output and
exit code.
"""
from __future__ import annotations

import sys

from ddb2bt.pipeline.services.jobs import acquire_lease, load, start_metrics_server, state_spec
from ddb2bt.pipeline.clients.bigtable.admin import BigtableAdmin
from ddb2bt.pipeline.observe.metrics import default_metrics


class RecoverBars:
    """The recover's progress bars (data files; the boundary sweep's rows) on
    ``file`` (stderr), for the length of a ``with`` block. The log lines written
    meanwhile go above the bars (tqdm.write), never into a bar's line; with no
    terminal (a log file, CI) there are no bars: carriage returns would only
    clutter the log."""

    def __init__(self, file=None) -> None:
        self._file = file or sys.stderr
        self._bars: dict = {}
        self._redirect = None

    def __enter__(self) -> "RecoverBars":
        import logging

        from tqdm.contrib.logging import logging_redirect_tqdm

        self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for bar in self._bars.values():
            bar.close()
        self._redirect.__exit__(*exc)

    def _bar(self, name: str, **kw):
        from tqdm import tqdm

        if name not in self._bars:
            tty = getattr(self._file, "isatty", lambda: False)()
            self._bars[name] = tqdm(dynamic_ncols=True, file=self._file, disable=not tty, **kw)
        return self._bars[name]

    def progress(self, done: int, total: int) -> None:
        bar = self._bar("files", total=total, unit="file", desc="recover")
        bar.n = done
        bar.update(0)

    def sweep_progress(self, rows: int) -> None:  # the boundary sweep's scan (docs/recover.md): no total known
        bar = self._bar("sweep", unit="row", desc="boundary sweep")
        bar.n = rows
        bar.update(0)


def cmd_recover(args) -> int:
    """Say what a trimmed checkpoint lost and how to export it; with --from-export,
    apply the exports and set the trimmed shards to resume (docs/recover.md)."""
    # inside: loaded when the command runs, not by --help (the CLI imports every service)
    from ddb2bt.pipeline.recover.recover import RecoverOptions, recover_job, refuse_kinesis
    mapping = load(args)
    refuse_kinesis(mapping)  # before any lease or state is touched
    spec = state_spec(args, mapping)
    options = RecoverOptions(exports=tuple(args.from_export or ()), s3_bucket=args.s3_bucket or "<bucket>",
                             s3_prefix=args.s3_prefix or "", accept_inexact=args.accept_inexact)
    fence, held = (lambda: None), None  # a read-only run writes nothing

    if not BigtableAdmin(spec.bigtable.project, spec.bigtable.instance).exists(spec.table):
        # No state table: this job never ran against this instance, so it has no
        # checkpoint to be trimmed (and nothing to hold a lease in).
        print(f"no state of job {spec.job!r} in {spec.bigtable.project}/{spec.bigtable.instance}/{spec.table}: "
              "it never ran here, so nothing is trimmed and there is nothing to recover (check --state-table, "
              "--bigtable-instance and --job-name)", file=sys.stderr)
        return 1
    if options.exports:  # writing: hold the tail's lease, so no `run` applies changes meanwhile
        # inside: loaded when the command runs, not by --help (the CLI imports every service)
        from ddb2bt.pipeline.control.coordinator import join

        start_metrics_server(args.metrics_port, args.metrics_host)
        held = join(acquire_lease(args, spec, "tail"))
        fence = held.check if held is not None else fence
    try:
        with RecoverBars() as bars:
            outcome = recover_job(mapping, spec, options, progress=bars.progress,
                                  fence=fence, sweep_progress=bars.sweep_progress,
                                  metrics=default_metrics().for_table(spec.job))
    finally:
        if held is not None:  # released at once: the tail (`ddb2bt run`) starts next
            held.release()
    for line in outcome.lines():
        print(line.replace("<mapping>", args.mapping[0] if isinstance(args.mapping, list) else str(args.mapping)))
    return 0
