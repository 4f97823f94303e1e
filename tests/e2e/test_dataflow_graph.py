"""The production job graphs, built offline with the DataflowRunner's dry run
(apache-beam[gcp], the `dataflow` extra), through the same CLI path as a launch."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.app import cli
from ddb2bt.pipeline.services import replicate, verify
from ddb2bt.pipeline.local import workload
from ddb2bt.pipeline.connect.connections import dynamodb_client
from ddb2bt.pipeline.dataflow import graph_facts, validate_options
from tests.conftest import write_mapping
from ddb2bt.transforms.errors import ConfigError

pytestmark = pytest.mark.e2e
DATAFLOW = ["--runner=DataflowRunner", "--dry_run=True", "--project=my-project", "--region=us-central1",
            "--temp_location=gs://my-bucket/tmp", "--staging_location=gs://my-bucket/staging"]
ORDERED = ("ReadStream", "WriteToBigtable")


@pytest.fixture
def launched(monkeypatch):
    results = []

    def capture(result, args):
        results.append(result)
        return 0
    # The services of run, backfill, migrate (replicate) and verify each report the launch.
    monkeypatch.setattr(replicate, "submitted", capture)
    monkeypatch.setattr(verify, "submitted", capture)
    return results


def setup(tmp_path, unique):
    path = write_mapping(tmp_path, source__table=f"Flow_{unique}", target__table=f"flow_{unique}",
                         name=f"flow_{unique}")
    ddb = dynamodb_client()
    workload.create_table(ddb, f"Flow_{unique}")
    assert cli.main(["create-table", "--mapping", str(path)]) == 0
    return path


def test_run_is_a_streaming_job_without_shuffles_on_the_ordered_path(stack, tmp_path, unique, launched):
    path = setup(tmp_path, unique)
    assert cli.main(["run", "--mapping", str(path), "--partitions", "8"] + DATAFLOW) == 0
    facts = graph_facts(launched[0].job, [ORDERED])
    assert facts.streaming
    for step in ("ReplicateToBigtable", "ReadDynamoDBStream", "StreamPartitions", "ReadStream", "MapToBigtable",
                 "MapChanges", "WriteToBigtableOrdered", "WriteToBigtable"):
        assert step in facts.steps
    assert facts.ordered_path_shuffles == ()


def test_backfill_is_a_batch_job(stack, tmp_path, unique, launched):
    path = setup(tmp_path, unique)
    assert cli.main(["backfill", "--mapping", str(path), "--segments", "16", "--tasks", "4"] + DATAFLOW) == 0
    facts = graph_facts(launched[0].job, [("ReadBackfill", "WriteBackfill")])
    assert not facts.streaming
    for step in ("BackfillParts", "SpreadParts", "ReadBackfill", "MapBackfill", "WriteBackfill"):
        assert step in facts.steps
    assert facts.ordered_path_shuffles == ()
    # the backfill is a splittable read (checkpoints, drain, update): one part per element
    assert [n for n in facts.splittable if "ReadBackfill" in n] == ["ReadBackfill/ReadParts"]


def test_migrate_is_one_streaming_job_with_tail_and_backfill(stack, tmp_path, unique, launched):
    path = setup(tmp_path, unique)
    assert cli.main(["migrate", "--mapping", str(path), "--segments", "16", "--tasks", "4"] + DATAFLOW) == 0
    facts = graph_facts(launched[0].job, [ORDERED, ("ReadBackfill", "WriteBackfill")])
    assert facts.streaming
    for step in ("ReadStream", "MapChanges", "WriteToBigtable", "ReadBackfill", "WriteBackfill"):
        assert step in facts.steps
    assert facts.ordered_path_shuffles == ()
    assert any("ReadBackfill/ReadParts" in n for n in facts.splittable)  # the backfill: splittable
    assert any("ReadStream" in n for n in facts.splittable)  # the stream source too


def setup_tables(tmp_path, unique, count=3):
    paths = []
    for i in range(count):
        path = write_mapping(tmp_path, source__table=f"Flow{i}_{unique}", target__table=f"flow{i}_{unique}",
                             name=f"flow{i}_{unique}")
        workload.create_table(dynamodb_client(), f"Flow{i}_{unique}")
        paths += ["--mapping", str(path)]
    assert cli.main(["create-table", *paths]) == 0
    return paths


def _leaf_names(job, step):
    from ddb2bt.pipeline.dataflow import _is_step

    return [t.unique_name for t in job.proto_pipeline.components.transforms.values()
            if not t.subtransforms and _is_step(t.unique_name, step)]


def test_three_tables_are_one_streaming_job_with_one_reader_and_no_shuffle(stack, tmp_path, unique, launched):
    paths = setup_tables(tmp_path, unique)
    assert cli.main(["run", *paths, "--partitions", "4"] + DATAFLOW) == 0
    (result,) = launched
    facts = graph_facts(result.job, [ORDERED])
    assert facts.streaming and facts.ordered_path_shuffles == ()
    # one reading stage for every stream (12 partitions), one mapping, one write
    assert len(_leaf_names(result.job, "ReadStream")) == len(_leaf_names(result.job, "WriteToBigtable")) == 1


def test_migrate_of_three_tables_is_one_streaming_job_with_a_backfill_per_table(stack, tmp_path, unique, launched):
    paths = setup_tables(tmp_path, unique)
    assert cli.main(["migrate", *paths, "--segments", "8", "--tasks", "2"] + DATAFLOW) == 0
    (result,) = launched
    facts = graph_facts(result.job, [ORDERED, ("ReadBackfill", "WriteBackfill")])
    assert facts.streaming and facts.ordered_path_shuffles == ()
    assert {f"Backfill[flow{i}_{unique}]" for i in range(3)} <= facts.steps
    assert len(_leaf_names(result.job, "ReadStream")) == 1
    assert cli.main(["backfill", *paths, "--segments", "8"] + DATAFLOW) == 0
    batch = graph_facts(launched[1].job, [("ReadBackfill", "WriteBackfill")])
    assert not batch.streaming and {f"Backfill[flow{i}_{unique}]" for i in range(3)} <= batch.steps


def test_the_shuffle_check_can_fail():
    """A Reshuffle inserted between read and write is detected."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    p = beam.Pipeline(options=PipelineOptions(DATAFLOW + ["--streaming"]))
    (p | "ReadStream" >> beam.Create([1]) | "Shuffle" >> beam.Reshuffle() | "WriteToBigtable" >> beam.Map(str))
    facts = graph_facts(p.run().job, [ORDERED])
    assert facts.ordered_path_shuffles


@pytest.mark.parametrize("args,field", [
    (["--region=us-central1", "--temp_location=gs://bkt/t"], "--project"),
    (["--project=My_Project", "--region=us-central1", "--temp_location=gs://bkt/t"], "--project"),
    (["--project=my-project", "--temp_location=gs://bkt/t"], "--region"),
    (["--project=my-project", "--region=us-central1"], "--temp_location"),
    (["--project=my-project", "--region=us-central1", "--temp_location=/tmp/x"], "--temp_location"),
    (["--project=my-project", "--region=us-central1", "--temp_location=gs://bkt/t", "--staging_location=s3://x"],
     "--staging_location"),
])
def test_options_are_validated_before_launch(args, field):
    with pytest.raises(ConfigError) as err:
        validate_options(args)
    assert str(err.value).startswith(field)


def test_verify_of_three_tables_is_a_batch_job_joining_source_and_target_rows(stack, tmp_path, unique, launched):
    paths = setup_tables(tmp_path, unique)
    assert cli.main(["verify", *paths, "--segments", "8", "--report", "gs://my-bucket/verify.json"] + DATAFLOW) == 0
    (result,) = launched
    facts = graph_facts(result.job)
    assert not facts.streaming
    assert {f"Verify[flow{i}_{unique}]" for i in range(3)} <= facts.steps
    for step in ("VerifySourceParts", "ReadSourceItems", "ExpectRows", "SplitTargetRanges", "ReadTargetRows",
                 "JoinByRow", "CompareRows", "BatchDivergentRows", "RecheckRows", "SummarizeVerify",
                 "WriteVerifyReport"):
        assert step in facts.steps, step
    assert len(_leaf_names(result.job, "ReadSourceItems")) == 3


@pytest.mark.parametrize("command", ["run", "migrate"])
def test_a_continuous_check_is_a_branch_of_its_own_without_shuffles(stack, tmp_path, unique, launched, command):
    """On Dataflow the continuous check is a branch of the streaming job (ticks →
    one check step each), joined to the ordered path by nothing."""
    path = setup(tmp_path, unique)
    assert cli.main([command, "--mapping", str(path), "--continuous-check", "50", "--continuous-check-segments",
                     "8"] + DATAFLOW) == 0
    facts = graph_facts(launched[0].job, [ORDERED, ("CheckTicks", "CheckStep")])
    assert facts.streaming and facts.ordered_path_shuffles == ()
    for step in ("ReadStream", "WriteToBigtable", "CheckContinuously", f"ContinuousCheck[flow_{unique}]",
                 "CheckTicks", "CheckStep"):
        assert step in facts.steps, step
    assert any("CheckTicks" in n for n in facts.splittable)  # the ticks: an unbounded splittable source
    # joined by nothing: no output of the check's branch is an input outside it, nor the other way round
    transforms = launched[0].job.proto_pipeline.components.transforms.values()
    leaves = [t for t in transforms if not t.subtransforms]
    inside = [t for t in leaves if t.unique_name.startswith("CheckContinuously/")]
    outside = [t for t in leaves if not t.unique_name.startswith("CheckContinuously/")]
    assert inside and outside
    made_inside = {pc for t in inside for pc in t.outputs.values()}
    made_outside = {pc for t in outside for pc in t.outputs.values()}
    assert not any(pc in made_inside for t in outside for pc in t.inputs.values())
    assert not any(pc in made_outside for t in inside for pc in t.inputs.values())
