#!/usr/bin/env bash
# Build and operate ddb2bt as a Dataflow Flex Template (docs/deploy-dataflow.md).
#
#   deploy/dataflow/flex.sh [--dry-run] build                          # image (Cloud Build) + template spec
#   deploy/dataflow/flex.sh params EXAMPLE OUT.json KEY=VALUE...       # your parameter file: a copy of
#                            deploy/dataflow/params/EXAMPLE.json (run, migrate, backfill, verify) with KEYs set
#                            (KEY= leaves KEY out; the example's Pushgateway URL is refused)
#   deploy/dataflow/flex.sh [--dry-run] run    [SIZING] PARAMS.json JOB   # launch (params: deploy/dataflow/params/*.json)
#   deploy/dataflow/flex.sh [--dry-run] update [SIZING] PARAMS.json JOB [OLD=NEW,...]  # replace a running job in place
#   deploy/dataflow/flex.sh [--dry-run] drain  JOB                     # stop reading, finish writing, keep checkpoints
#
# --dry-run prints the exact gcloud commands instead of running them.
# Before a launch (run, update) the parameter file is checked: its mapping must be
# a gs:// path (not the example's gs://my-bucket/...) and readable (gcloud storage
# ls, with your credentials); one outside $BUCKET is warned about (the workers'
# service account is granted $BUCKET only). With --workers/--max-workers and
# --machine-type, partitions, tasks and segments must fit them (about 2 partitions
# per worker, a task per vCPU, 4 segments per task; docs/deploy-dataflow.md#7-sizing):
# a misfit is refused with the values that fit; --skip-sizing-check launches anyway.
# Its metrics_pushgateway, if any, must be an http(s) URL the workers reach: not
# the example's http://pushgateway.monitoring.internal:9091, not a loopback address.
# SIZING (run, update):
#   --workers N              workers at start (gcloud --num-workers)
#   --max-workers N          autoscaling ceiling (--max-workers)
#   --machine-type TYPE      worker machine type (--worker-machine-type), e.g. n2-standard-4
#   --subnetwork SUBNET      regions/REGION/subnetworks/NAME or its full URL (--subnetwork)
#   --no-public-ips          workers without external IPs (--disable-public-ips): needs Cloud NAT to reach AWS
#   --no-streaming-engine    do not pass --enable-streaming-engine (passed by default for run and migrate)
#   --service-account EMAIL  the launcher VM's and the workers' identity (--service-account-email;
#                            default $SERVICE_ACCOUNT)
#   --skip-sizing-check      launch even when partitions/tasks/segments do not fit the workers
#
# Environment: PROJECT, REGION (near the Bigtable cluster), BUCKET (templates and
# temp files), REPO (Artifact Registry repository, default ddb2bt), optional TAG,
# SERVICE_ACCOUNT (the worker service account), and for build AWS_ROLE_ARN (the
# role the workers' credential_process assumes, see deploy/aws/setup.sh).
set -euo pipefail
CALLER_PWD="$PWD"  # parameter files are named relative to where you are
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/lib.sh
. deploy/lib.sh

usage() { header >&2; exit 2; }

workers="" max_workers="" machine_type="" subnetwork="" no_public_ips=0 streaming_engine=1 sizing_check=1
service_account="${SERVICE_ACCOUNT:-}"
positional=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --workers) workers="${2:?--workers N}"; shift ;;
    --workers=*) workers="${1#*=}" ;;
    --max-workers) max_workers="${2:?--max-workers N}"; shift ;;
    --max-workers=*) max_workers="${1#*=}" ;;
    --machine-type) machine_type="${2:?--machine-type TYPE}"; shift ;;
    --machine-type=*) machine_type="${1#*=}" ;;
    --subnetwork) subnetwork="${2:?--subnetwork SUBNET}"; shift ;;
    --subnetwork=*) subnetwork="${1#*=}" ;;
    --no-public-ips) no_public_ips=1 ;;
    --no-streaming-engine) streaming_engine=0 ;;
    --skip-sizing-check) sizing_check=0 ;;
    --service-account) service_account="${2:?--service-account EMAIL}"; shift ;;
    --service-account=*) service_account="${1#*=}" ;;
    -h|--help) header; exit 0 ;;
    --*) die "unknown option $1 (see --help)" ;;
    *) positional+=("$1") ;;
  esac
  shift
done
set -- "${positional[@]+"${positional[@]}"}"

# The example parameter files' Pushgateway: a placeholder, refused like the example's mapping.
EXAMPLE_PUSHGATEWAY="http://pushgateway.monitoring.internal:9091"

here() {  # a path as the caller meant it (the script runs from the repository's root)
  case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$CALLER_PWD/$1" ;; esac
}

if [ "${1:-}" = params ]; then  # needs no cloud environment: it writes a local file
  example="${2:?params EXAMPLE OUT.json KEY=VALUE... (EXAMPLE: run, migrate, backfill, verify)}"
  out="$(here "${3:?params EXAMPLE OUT.json KEY=VALUE...}")"
  src="deploy/dataflow/params/${example%.json}.json"
  [ -f "$src" ] || die "no example parameter file $src (examples: run, migrate, backfill, verify)"
  [ ! -e "$out" ] || die "$out exists: edit it, or remove it first"
  shift 3
  python3 - "$src" "$out" "$EXAMPLE_PUSHGATEWAY" "$@" <<'EOF' || exit 2
import json, sys
src, out, example_gateway, pairs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
params = json.load(open(src))
for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or not key:
        sys.exit(f"flex.sh: {pair!r} is not KEY=VALUE")
    if key == "metrics_pushgateway" and value.rstrip("/") == example_gateway:
        sys.exit(f"flex.sh: metrics_pushgateway={value} is the example's address, not a Pushgateway of yours: "
                 "give your Pushgateway's URL (docs/deploy-dataflow.md#10-metrics-on-dataflow), "
                 "or metrics_pushgateway= to push no metrics")
    if value:
        params[key] = value
    else:  # KEY= leaves KEY out
        params.pop(key, None)
open(out, "w").write(json.dumps(params, indent=2) + "\n")
print(f"wrote {out} (from {src}): " + ", ".join(f"{k}={v}" for k, v in params.items()), file=sys.stderr)
if params.get("metrics_pushgateway", "").rstrip("/") == example_gateway:
    print(f"flex.sh: note: metrics_pushgateway is still the example's {example_gateway}; a launch refuses it: "
          "set metrics_pushgateway=YOUR_URL (docs/deploy-dataflow.md#10-metrics-on-dataflow), "
          "or metrics_pushgateway= to push no metrics", file=sys.stderr)
EOF
  exit 0
fi
for n in "$workers" "$max_workers"; do
  [ -z "$n" ] || [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "worker counts must be positive integers, got '$n'"
done
if [ -n "$workers" ] && [ -n "$max_workers" ] && [ "$workers" -gt "$max_workers" ]; then
  die "--workers ($workers) is more than --max-workers ($max_workers)"
fi

: "${PROJECT:?set PROJECT}" "${REGION:?set REGION}" "${BUCKET:?set BUCKET}" "${REPO:=ddb2bt}"
TAG="${TAG:-$(git rev-parse --short HEAD 2>/dev/null || echo latest)}"
IMAGE="${REGION}-docker.pkg.dev/${PROJECT}/${REPO}/ddb2bt:${TAG}"
TEMPLATE="gs://${BUCKET}/templates/ddb2bt-${TAG}.json"

params() {  # PARAMS.json → k=v pairs joined by the ^~^ delimiter (values may hold commas)
  python3 -c 'import json,sys; print("^~^" + "~".join(f"{k}={v}" for k, v in json.load(open(sys.argv[1])).items()))' "$1"
}

command_of() {  # PARAMS.json → its "command" (run, backfill, migrate)
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("command", ""))' "$1"
}

check_mapping() {  # PARAMS.json: the mapping is where the launcher and the workers read it
  local file="$1" mapping m maps
  mapping="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("mapping", ""))' "$file")"
  [ -n "$mapping" ] || die "$file has no \"mapping\" (the gs:// path of your mapping)"
  IFS=, read -r -a maps <<< "$mapping"
  for m in "${maps[@]}"; do
    case "$m" in
      example:*) continue ;;  # a packaged example: inside the image
      gs://my-bucket/*) [ "$BUCKET" = my-bucket ] ||
        die "$file: mapping $m is still the example's; set it to your mapping in gs://$BUCKET/ (step 6: flex.sh params ... mapping=gs://$BUCKET/ddb2bt/NAME.yaml)" ;;
      gs://*) ;;
      *) die "$file: mapping $m is not a gs:// path: the launcher VM and the workers cannot read a local file; gcloud storage cp it to gs://$BUCKET/ddb2bt/ and name that" ;;
    esac
    case "$m" in
      "gs://$BUCKET/"*) ;;
      *) echo "$(basename "$0"): warning: mapping $m is outside gs://$BUCKET/: the workers read it as ${service_account:-their service account}, which deploy/gcp/setup.sh grants gs://$BUCKET only; grant it roles/storage.objectViewer there or copy the mapping into gs://$BUCKET/ddb2bt/" >&2 ;;
    esac
    if [ "$DRY_RUN" = 1 ]; then
      quote gcloud storage ls "$m"
    else
      gcloud storage ls "$m" > /dev/null || die "cannot read the mapping $m (gcloud storage ls failed, see above)"
    fi
  done
}

check_pushgateway() {  # PARAMS.json: a metrics_pushgateway the workers can reach, not the example's
  local file="$1" gateway
  gateway="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("metrics_pushgateway", ""))' "$file")"
  case "${gateway%/}" in
    "") ;;
    "$EXAMPLE_PUSHGATEWAY")
      die "$file: metrics_pushgateway $gateway is still the example's; set it to your Pushgateway (docs/deploy-dataflow.md#10-metrics-on-dataflow: flex.sh params ... metrics_pushgateway=http://HOST:9091), or remove the key to push no metrics" ;;
    http://localhost*|https://localhost*|http://127.*|https://127.*)
      die "$file: metrics_pushgateway $gateway is a loopback address: a Dataflow worker would push to itself; give an address the workers reach (docs/deploy-dataflow.md#10-metrics-on-dataflow)" ;;
    http://*|https://*) ;;
    *) die "$file: metrics_pushgateway $gateway is not an http:// or https:// URL (e.g. http://HOST:9091)" ;;
  esac
}

check_sizing() {  # PARAMS.json: partitions, tasks, segments fit the workers and vCPUs asked for
  local file="$1" most="${max_workers:-$workers}" vcpus=""
  [ "$sizing_check" = 1 ] && [ -n "$most" ] || return 0
  if [[ "$machine_type" =~ -([0-9]+)$ ]]; then vcpus="${BASH_REMATCH[1]}"; fi
  python3 - "$file" "$most" "$vcpus" <<'EOF' || exit 2
import json, sys
params = json.load(open(sys.argv[1]))
workers, vcpus = int(sys.argv[2]), int(sys.argv[3]) if sys.argv[3] else None
# docs/deploy-dataflow.md#7-sizing: about 2 partitions per worker (more only idle,
# fewer leave workers without a reader), a backfill task per vCPU (one SDK process
# each), at least 4 segments per task (uneven segments even out); SLACK: how far
# either way from the fit is still taken as meant.
PARTITIONS_PER_WORKER, SLACK, SEGMENTS_PER_TASK = 2, 2, 4
problems, fits = [], {}
if "partitions" in params:
    want = PARTITIONS_PER_WORKER * workers
    fits["partitions"] = want
    if not want / SLACK <= int(params["partitions"]) <= want * SLACK:
        problems.append(f"partitions={params['partitions']}")
if "tasks" in params and vcpus:
    want = workers * vcpus
    fits["tasks"] = want
    if not want / SLACK <= int(params["tasks"]) <= want * SLACK:
        problems.append(f"tasks={params['tasks']}")
if "segments" in params and "tasks" in params:
    fits["segments"] = SEGMENTS_PER_TASK * fits.get("tasks", int(params["tasks"]))
    if int(params["segments"]) < SEGMENTS_PER_TASK * int(params["tasks"]) or problems:
        problems.append(f"segments={params['segments']}")
if problems:
    size = f"{workers} worker(s)" + (f" of {vcpus} vCPUs" if vcpus else "")
    sys.exit(f"flex.sh: {sys.argv[1]}: {' '.join(problems)} do not fit at most {size}; for them set "
             + " ".join(f"{k}={v}" for k, v in fits.items())
             + " (scale partitions, tasks and segments together: docs/deploy-dataflow.md#7-sizing), "
             "or pass --skip-sizing-check")
EOF
}

launch() {  # JOB PARAMS.json [extra gcloud flags...]
  local job="$1" file; file="$(here "$2")"; shift 2
  [ -f "$file" ] || die "no parameter file $file"
  check_sizing "$file"
  check_mapping "$file"
  check_pushgateway "$file"
  local sizing=()
  [ -n "$workers" ] && sizing+=(--num-workers="$workers")
  [ -n "$max_workers" ] && sizing+=(--max-workers="$max_workers")
  [ -n "$machine_type" ] && sizing+=(--worker-machine-type="$machine_type")
  [ -n "$subnetwork" ] && sizing+=(--subnetwork="$subnetwork")
  [ "$no_public_ips" = 1 ] && sizing+=(--disable-public-ips)
  case "$(command_of "$file")" in
    run|migrate) [ "$streaming_engine" = 1 ] && sizing+=(--enable-streaming-engine) ;;
  esac
  [ -n "$service_account" ] && sizing+=(--service-account-email="$service_account")
  run gcloud dataflow flex-template run "$job" \
    --project="$PROJECT" --region="$REGION" \
    --template-file-gcs-location="$TEMPLATE" \
    --temp-location="gs://${BUCKET}/tmp" --staging-location="gs://${BUCKET}/staging" \
    "${sizing[@]}" \
    --parameters="$(params "$file")" \
    --parameters="sdk_container_image=${IMAGE}" \
    "$@"
}

case "${1:-}" in
  build)
    : "${AWS_ROLE_ARN:?set AWS_ROLE_ARN (the role the workers assume; deploy/aws/setup.sh prints it)}"
    run gcloud builds submit --project="$PROJECT" --config=deploy/dataflow/cloudbuild.yaml \
      --substitutions="_IMAGE=${IMAGE},_AWS_ROLE_ARN=${AWS_ROLE_ARN}" .
    run gcloud dataflow flex-template build "$TEMPLATE" --project="$PROJECT" \
      --image="$IMAGE" --sdk-language=PYTHON --metadata-file=deploy/dataflow/metadata.json
    [ "$DRY_RUN" = 1 ] || echo "template: $TEMPLATE"
    ;;
  run)
    launch "${3:?job name}" "${2:?params file}"
    ;;
  update)
    # Step names are stable (StreamPartitions, ReadStream, MapChanges, WriteToBigtable,
    # BackfillTasks, ReadBackfill, MapBackfill, WriteBackfill); if you rename one, pass
    # MAPPINGS as gcloud's OldName=NewName[,OldName2=NewName2].
    extra=(--update)
    if [ -n "${4:-}" ]; then
      [[ "$4" =~ ^[^=,]+=[^=,]+(,[^=,]+=[^=,]+)*$ ]] || die "MAPPINGS must be OldName=NewName[,...], got '$4'"
      extra+=(--transform-name-mappings="$4")
    fi
    launch "${3:?job name (the running job)}" "${2:?params file}" "${extra[@]}"
    ;;
  drain)
    job="${2:?job name}"
    if [ "$DRY_RUN" = 1 ]; then
      quote gcloud dataflow jobs list --project="$PROJECT" --region="$REGION" --status=active \
        --filter="name=${job}" --format='value(id)'
      quote gcloud dataflow jobs drain "<id of the active job ${job}>" --project="$PROJECT" --region="$REGION"
      exit 0
    fi
    id=$(gcloud dataflow jobs list --project="$PROJECT" --region="$REGION" --status=active \
         --filter="name=${job}" --format='value(id)' | head -1)
    [ -n "$id" ] || { echo "no active job named $job" >&2; exit 1; }
    gcloud dataflow jobs drain "$id" --project="$PROJECT" --region="$REGION"
    ;;
  *)
    usage ;;
esac
