"""One worker process of a Dataflow job, played locally: ``ddb2bt run`` whose
lease is the job's shared one (holder ``dataflow:<JOB>``, as on Dataflow) instead
of a process's own, so several such processes of one job share the job lease and
split the stream partitions between them by partition ownership
(``ddb2bt.pipeline.control.partitions.PartitionOwners``). Test-only.

    python -m ddb2bt.pipeline.testing.dataflow_worker JOB [faults options] -- <ddb2bt run arguments>

Everything after JOB is ``python -m ddb2bt.pipeline.testing.faults``'s command
line (fault spec, ``--log-writes FILE``, then ``--`` and the ddb2bt arguments).
"""
from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list] = None) -> int:
    from ddb2bt.pipeline.control import coordinator
    from ddb2bt.pipeline.testing import faults

    argv = list(sys.argv[1:] if argv is None else argv)
    job, rest = argv[0], argv[1:]
    hold = coordinator.hold

    def hold_for_the_job(state_spec, role, options, *, command, dataflow_job=None):
        # What the launcher does on Dataflow: take the job's lease for the job
        # (every worker renews it under the job's name), not for this process.
        return hold(state_spec, role, options, command=command, dataflow_job=job)

    coordinator.hold = hold_for_the_job
    return faults.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
