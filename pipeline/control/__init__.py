"""The control floor: who may write, and in which phase.

Everything that decides ownership lives here, above the clients and below the
stages that read and write: the job lease (``lease.py``) and partition ownership (``partitions.py``), one job
per target table (``ownership.py``), the state store of checkpoints, dead letters
and the migration's facts (``state.py``), version claims (``versions.py``), the
migration's phases and marking policy (``phases.py``), the clock check
(``clock.py``), the keeper that moves the phase where no controller runs
(``keeper.py``), when the tail has caught up (``catchup.py``) and the touch-marker family (``markers.py``). One coordinator
per job and stream in each process (``coordinator.py``) is the one home of the
process's ownership state. No Beam here: the readers and the sink ask this
floor, never the other way round (docs/how-it-works.md)."""
