#!/usr/bin/env bash
# Build and operate ddb2bt as a Dataflow Flex Template.
#
#   deploy/dataflow/flex.sh build                       # image (Cloud Build) + template spec
#   deploy/dataflow/flex.sh run    PARAMS.json JOB      # launch (params: deploy/dataflow/params/*.json)
#   deploy/dataflow/flex.sh update PARAMS.json JOB [MAPPINGS]   # replace a running streaming job in place
#   deploy/dataflow/flex.sh drain  JOB                  # stop reading, finish writing, keep checkpoints
#
# Environment: PROJECT, REGION (near the Bigtable cluster), BUCKET (templates and
# temp files), REPO (Artifact Registry repository, e.g. ddb2bt), optional TAG,
# SERVICE_ACCOUNT (the worker service account, see deploy/iam.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${PROJECT:?set PROJECT}" "${REGION:?set REGION}" "${BUCKET:?set BUCKET}" "${REPO:=ddb2bt}"
TAG="${TAG:-$(git rev-parse --short HEAD 2>/dev/null || echo latest)}"
IMAGE="${REGION}-docker.pkg.dev/${PROJECT}/${REPO}/ddb2bt:${TAG}"
TEMPLATE="gs://${BUCKET}/templates/ddb2bt-${TAG}.json"

params() {  # PARAMS.json → k=v pairs joined by the ^~^ delimiter (values may hold commas)
  python3 -c 'import json,sys; print("^~^" + "~".join(f"{k}={v}" for k, v in json.load(open(sys.argv[1])).items()))' "$1"
}

launch() {  # JOB PARAMS.json [extra gcloud flags...]
  local job="$1" file="$2"; shift 2
  gcloud dataflow flex-template run "$job" \
    --project="$PROJECT" --region="$REGION" \
    --template-file-gcs-location="$TEMPLATE" \
    --temp-location="gs://${BUCKET}/tmp" --staging-location="gs://${BUCKET}/staging" \
    ${SERVICE_ACCOUNT:+--service-account-email="$SERVICE_ACCOUNT"} \
    --parameters="$(params "$file")" \
    --parameters="sdk_container_image=${IMAGE}" \
    "$@"
}

case "${1:-}" in
  build)
    gcloud builds submit --project="$PROJECT" --tag="$IMAGE" .
    gcloud dataflow flex-template build "$TEMPLATE" --project="$PROJECT" \
      --image="$IMAGE" --sdk-language=PYTHON --metadata-file=deploy/dataflow/metadata.json
    echo "template: $TEMPLATE"
    ;;
  run)
    launch "${3:?job name}" "${2:?params file}"
    ;;
  update)
    # Step names are stable (StreamPartitions, ReadStream, MapChanges, WriteToBigtable,
    # BackfillTasks, ReadBackfill, MapBackfill, WriteBackfill); if you rename one, pass
    # MAPPINGS as a JSON object {"OldName": "NewName"}.
    extra=(--parameters=update=true)
    [ -n "${4:-}" ] && extra+=(--transform-name-mappings="$4")
    launch "${3:?job name (the running job)}" "${2:?params file}" "${extra[@]}"
    ;;
  drain)
    id=$(gcloud dataflow jobs list --project="$PROJECT" --region="$REGION" --status=active \
         --filter="name=${2:?job name}" --format='value(id)' | head -1)
    [ -n "$id" ] || { echo "no active job named $2" >&2; exit 1; }
    gcloud dataflow jobs drain "$id" --project="$PROJECT" --region="$REGION"
    ;;
  *)
    sed -n '2,13p' "$0"; exit 2 ;;
esac
