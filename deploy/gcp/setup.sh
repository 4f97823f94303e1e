#!/usr/bin/env bash
# The Google Cloud side of a ddb2bt deployment, from an empty project: APIs, the
# image repository, the bucket, two service accounts with exactly the roles they
# need, and Cloud NAT so that workers without public IPs reach AWS.
#
#   deploy/gcp/setup.sh [--dry-run] [--no-nat]
#
# --dry-run  print the exact gcloud commands instead of running them (for an
#            empty project: it does not look at what already exists)
# --no-nat   skip the Cloud Router / Cloud NAT (workers keep public IPs, or your
#            network already has a NAT)
#
# Environment:
#   PROJECT, REGION      where the job runs (near the Bigtable cluster)
#   BUCKET               temp/staging files, the template spec and the mapping files
#   BIGTABLE_INSTANCE    the target instance (it holds the state table too)
#   REPO                 Artifact Registry repository (default ddb2bt)
#   NETWORK, SUBNETWORK  VPC and subnetwork of the workers (default: default, default)
#   WORKER_SA, LAUNCHER_SA  account names (default ddb2bt-worker, ddb2bt-launcher)
#
# The two identities (docs/deploy-dataflow.md#service-accounts):
#   worker   runs the Flex Template launcher VM AND the workers (Dataflow uses
#            one --service-account-email for both): the launcher VM takes the
#            job's lease and fixes the handoff time, so this account writes the
#            state table; the workers read DynamoDB (AWS role, deploy/aws/) and
#            write Bigtable.
#   launcher builds the image and the template, launches, updates and drains
#            (a CI pipeline, or an operator impersonating it); it needs no data access.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/lib.sh
. deploy/lib.sh

nat=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --no-nat) nat=0 ;;
    -h|--help) header; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
  esac
done

: "${PROJECT:?set PROJECT}" "${REGION:?set REGION}" "${BUCKET:?set BUCKET}"
: "${BIGTABLE_INSTANCE:?set BIGTABLE_INSTANCE}"
REPO="${REPO:-ddb2bt}" NETWORK="${NETWORK:-default}" SUBNETWORK="${SUBNETWORK:-default}"
WORKER="${WORKER_SA:-ddb2bt-worker}@${PROJECT}.iam.gserviceaccount.com"
LAUNCHER="${LAUNCHER_SA:-ddb2bt-launcher}@${PROJECT}.iam.gserviceaccount.com"
SCHEMA_ROLE="projects/${PROJECT}/roles/ddb2btTableSchema"

# exists DESCRIBE-COMMAND... || run CREATE-COMMAND...: creates only what is missing
# (a dry run prints the create command: it assumes an empty project).
exists() { [ "$DRY_RUN" != 1 ] && "$@" >/dev/null 2>&1; }

# 1. APIs
run gcloud services enable dataflow.googleapis.com compute.googleapis.com \
  bigtable.googleapis.com bigtableadmin.googleapis.com artifactregistry.googleapis.com \
  cloudbuild.googleapis.com storage.googleapis.com iam.googleapis.com \
  logging.googleapis.com monitoring.googleapis.com --project="$PROJECT"

# 2. Image repository and bucket
exists gcloud artifacts repositories describe "$REPO" --location="$REGION" --project="$PROJECT" ||
  run gcloud artifacts repositories create "$REPO" --repository-format=docker --location="$REGION" \
    --project="$PROJECT" --description="ddb2bt launcher and worker image"
exists gcloud storage buckets describe "gs://${BUCKET}" --project="$PROJECT" ||
  run gcloud storage buckets create "gs://${BUCKET}" --project="$PROJECT" --location="$REGION" \
    --uniform-bucket-level-access
# gcloud builds submit uploads the source to the project's default Cloud Build
# bucket; created here so that the launcher needs no project-wide storage role.
exists gcloud storage buckets describe "gs://${PROJECT}_cloudbuild" --project="$PROJECT" ||
  run gcloud storage buckets create "gs://${PROJECT}_cloudbuild" --project="$PROJECT" --location="$REGION" \
    --uniform-bucket-level-access

# 3. Service accounts
exists gcloud iam service-accounts describe "$WORKER" --project="$PROJECT" ||
  run gcloud iam service-accounts create "${WORKER%%@*}" --project="$PROJECT" \
    --display-name="ddb2bt Dataflow launcher VM and workers"
exists gcloud iam service-accounts describe "$LAUNCHER" --project="$PROJECT" ||
  run gcloud iam service-accounts create "${LAUNCHER%%@*}" --project="$PROJECT" \
    --display-name="ddb2bt build, launch, update, drain"

# 4. Worker roles (also the launcher VM's: it writes the lease and the handoff
#    time into the state table, on the same instance)
run gcloud projects add-iam-policy-binding "$PROJECT" --member="serviceAccount:${WORKER}" \
  --role=roles/dataflow.worker --condition=None
run gcloud bigtable instances add-iam-policy-binding "$BIGTABLE_INSTANCE" --project="$PROJECT" \
  --member="serviceAccount:${WORKER}" --role=roles/bigtable.user
# migrate/backfill add and drop the touch-marker family on the target tables
exists gcloud iam roles describe ddb2btTableSchema --project="$PROJECT" ||
  run gcloud iam roles create ddb2btTableSchema --project="$PROJECT" --stage=GA \
    --title="ddb2bt table schema" --description="Add and drop the ddb2bt touch-marker column family" \
    --permissions=bigtable.tables.get,bigtable.tables.update
run gcloud bigtable instances add-iam-policy-binding "$BIGTABLE_INSTANCE" --project="$PROJECT" \
  --member="serviceAccount:${WORKER}" --role="$SCHEMA_ROLE"
run gcloud storage buckets add-iam-policy-binding "gs://${BUCKET}" \
  --member="serviceAccount:${WORKER}" --role=roles/storage.objectAdmin
run gcloud artifacts repositories add-iam-policy-binding "$REPO" --location="$REGION" --project="$PROJECT" \
  --member="serviceAccount:${WORKER}" --role=roles/artifactregistry.reader

# 5. Launcher roles
run gcloud projects add-iam-policy-binding "$PROJECT" --member="serviceAccount:${LAUNCHER}" \
  --role=roles/dataflow.developer --condition=None
run gcloud projects add-iam-policy-binding "$PROJECT" --member="serviceAccount:${LAUNCHER}" \
  --role=roles/cloudbuild.builds.editor --condition=None
run gcloud projects add-iam-policy-binding "$PROJECT" --member="serviceAccount:${LAUNCHER}" \
  --role=roles/serviceusage.serviceUsageConsumer --condition=None
run gcloud storage buckets add-iam-policy-binding "gs://${PROJECT}_cloudbuild" \
  --member="serviceAccount:${LAUNCHER}" --role=roles/storage.objectAdmin
run gcloud iam service-accounts add-iam-policy-binding "$WORKER" --project="$PROJECT" \
  --member="serviceAccount:${LAUNCHER}" --role=roles/iam.serviceAccountUser
run gcloud storage buckets add-iam-policy-binding "gs://${BUCKET}" \
  --member="serviceAccount:${LAUNCHER}" --role=roles/storage.objectAdmin
run gcloud artifacts repositories add-iam-policy-binding "$REPO" --location="$REGION" --project="$PROJECT" \
  --member="serviceAccount:${LAUNCHER}" --role=roles/artifactregistry.writer
# ddb2bt status from the pipeline that launched the job: read the state table
run gcloud bigtable instances add-iam-policy-binding "$BIGTABLE_INSTANCE" --project="$PROJECT" \
  --member="serviceAccount:${LAUNCHER}" --role=roles/bigtable.reader

# 6. Networking: workers without public IPs reach Google APIs through Private
#    Google Access and AWS (DynamoDB, Streams, STS, S3) through Cloud NAT.
if [ "$nat" = 1 ]; then
  run gcloud compute networks subnets update "$SUBNETWORK" --region="$REGION" --project="$PROJECT" \
    --enable-private-ip-google-access
  exists gcloud compute routers describe ddb2bt-router --region="$REGION" --project="$PROJECT" ||
    run gcloud compute routers create ddb2bt-router --network="$NETWORK" --region="$REGION" --project="$PROJECT"
  exists gcloud compute routers nats describe ddb2bt-nat --router=ddb2bt-router --region="$REGION" --project="$PROJECT" ||
    run gcloud compute routers nats create ddb2bt-nat --router=ddb2bt-router --region="$REGION" \
      --project="$PROJECT" --auto-allocate-nat-external-ips --nat-all-subnet-ip-ranges
fi
# Dataflow workers talk to each other on TCP 12345-12346 (the default network's
# default-allow-internal rule covers it; a custom network needs this rule).
exists gcloud compute firewall-rules describe ddb2bt-dataflow-internal --project="$PROJECT" ||
  run gcloud compute firewall-rules create ddb2bt-dataflow-internal --project="$PROJECT" --network="$NETWORK" \
    --direction=INGRESS --action=allow --rules=tcp:12345-12346 --source-tags=dataflow --target-tags=dataflow

# 7. What the AWS side needs: the worker's unique id (deploy/aws/setup.sh)
if [ "$DRY_RUN" = 1 ]; then
  quote gcloud iam service-accounts describe "$WORKER" --project="$PROJECT" --format='value(uniqueId)'
else
  echo "GOOGLE_SA_UNIQUE_ID=$(gcloud iam service-accounts describe "$WORKER" --project="$PROJECT" --format='value(uniqueId)')"
  echo "SERVICE_ACCOUNT=${WORKER}"
fi
