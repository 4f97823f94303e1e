"""A deterministic simulation of production (test-only): one seed drives a
simulated clock and every choice; the product's own reading DoFn, reader,
pacer, shard directory, coordinator and sink run against a simulated DynamoDB
stream (aws.py), a simulated Bigtable (bigtable.py) and a simulated Dataflow
runner (dataflow.py, workers.py), and an oracle (oracle.py) judges the run from
the simulated services' records. ``scenario.run_simulation`` runs one seed;
``bench/simulate.py`` runs many."""
