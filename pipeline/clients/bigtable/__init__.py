"""The Bigtable client, one concern per module: ``errors`` (gRPC codes classified
once: retryable or permanent), ``channel`` (endpoint, channel, probe, bounded
close), ``wire`` (the MutateRows encoder), ``writer`` (MutateRows and
CheckAndMutateRow, with a fence hook), ``admin`` (tables, families, app
profiles, the per-process admin cache) and ``reads`` (ReadRows helpers)."""
