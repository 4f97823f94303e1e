#!/usr/bin/env bash
# Build and operate ddb2bt as a Dataflow Flex Template (docs/deploy-dataflow.md).
#
#   deploy/dataflow/flex.sh [--dry-run] build                          # image (Cloud Build) + template spec
#   deploy/dataflow/flex.sh [--dry-run] run    [SIZING] PARAMS.json JOB   # launch (params: deploy/dataflow/params/*.json)
#   deploy/dataflow/flex.sh [--dry-run] update [SIZING] PARAMS.json JOB [OLD=NEW,...]  # replace a running job in place
#   deploy/dataflow/flex.sh [--dry-run] drain  JOB                     # stop reading, finish writing, keep checkpoints
#
# --dry-run prints the exact gcloud commands instead of running them.
# SIZING (run, update):
#   --workers N              workers at start (gcloud --num-workers)
#   --max-workers N          autoscaling ceiling (--max-workers)
#   --machine-type TYPE      worker machine type (--worker-machine-type), e.g. n2-standard-4
#   --subnetwork SUBNET      regions/REGION/subnetworks/NAME or its full URL (--subnetwork)
#   --no-public-ips          workers without external IPs (--disable-public-ips): needs Cloud NAT to reach AWS
#   --no-streaming-engine    do not pass --enable-streaming-engine (passed by default for run and migrate)
#   --service-account EMAIL  the launcher VM's and the workers' identity (--service-account-email;
#                            default $SERVICE_ACCOUNT)
#
# Environment: PROJECT, REGION (near the Bigtable cluster), BUCKET (templates and
# temp files), REPO (Artifact Registry repository, default ddb2bt), optional TAG,
# SERVICE_ACCOUNT (the worker service account), and for build AWS_ROLE_ARN (the
# role the workers' credential_process assumes, see deploy/aws/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/lib.sh
. deploy/lib.sh

usage() { header >&2; exit 2; }

workers="" max_workers="" machine_type="" subnetwork="" no_public_ips=0 streaming_engine=1
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
    --service-account) service_account="${2:?--service-account EMAIL}"; shift ;;
    --service-account=*) service_account="${1#*=}" ;;
    -h|--help) header; exit 0 ;;
    --*) die "unknown option $1 (see --help)" ;;
    *) positional+=("$1") ;;
  esac
  shift
done
set -- "${positional[@]+"${positional[@]}"}"
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

launch() {  # JOB PARAMS.json [extra gcloud flags...]
  local job="$1" file="$2"; shift 2
  [ -f "$file" ] || die "no parameter file $file"
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
