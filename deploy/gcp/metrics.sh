#!/usr/bin/env bash
# Metrics for a Dataflow job: one small VM beside the workers running a Prometheus
# Pushgateway (the workers push to it), Prometheus (scrapes it, evaluates
# deploy/prometheus/alerts.yml) and Grafana (deploy/grafana/dashboard.json).
# docs/deploy-dataflow.md#10-metrics-on-dataflow.
#
#   deploy/gcp/metrics.sh [--dry-run]
#
# --dry-run  print the exact gcloud commands instead of running them
#
# What it creates: a firewall rule letting the Dataflow workers (network tag
# `dataflow`) reach the Pushgateway on tcp:9091, one letting IAP reach the VM's
# ssh (for the tunnel to Prometheus and Grafana), and the VM: no external IP, no
# service account, Debian; deploy/gcp/metrics-startup.sh starts the three
# containers at every boot (their images are pulled through the Cloud NAT of
# deploy/gcp/setup.sh). Only the Pushgateway listens beyond the VM; Prometheus
# and Grafana listen on the VM's 127.0.0.1, reached through the tunnel.
#
# Environment:
#   PROJECT, REGION      the job's project and region
#   ZONE                 the VM's zone (default REGION-a)
#   NETWORK, SUBNETWORK  the workers' VPC and subnetwork (default: default, default)
#   METRICS_VM           the VM's name (default ddb2bt-metrics)
#   METRICS_MACHINE      its machine type (default e2-small)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/lib.sh
. deploy/lib.sh

for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) header; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
  esac
done

: "${PROJECT:?set PROJECT}" "${REGION:?set REGION}"
ZONE="${ZONE:-${REGION}-a}"
NETWORK="${NETWORK:-default}" SUBNETWORK="${SUBNETWORK:-default}"
METRICS_VM="${METRICS_VM:-ddb2bt-metrics}" METRICS_MACHINE="${METRICS_MACHINE:-e2-small}"
[[ "$ZONE" == "$REGION"-* ]] || die "ZONE ($ZONE) is not in REGION ($REGION): put the VM beside the workers"
for f in deploy/gcp/metrics-startup.sh deploy/prometheus/alerts.yml deploy/grafana/dashboard.json; do
  [ -f "$f" ] || die "missing $f (run from a clone of the repository)"
done

run gcloud compute firewall-rules create "${METRICS_VM}-push" --project="$PROJECT" --network="$NETWORK" \
  --direction=INGRESS --allow=tcp:9091 --source-tags=dataflow --target-tags="$METRICS_VM" \
  --description="Dataflow workers push ddb2bt metrics to the Pushgateway"
run gcloud compute firewall-rules create "${METRICS_VM}-iap-ssh" --project="$PROJECT" --network="$NETWORK" \
  --direction=INGRESS --allow=tcp:22 --source-ranges=35.235.240.0/20 --target-tags="$METRICS_VM" \
  --description="IAP tunnel to the ddb2bt metrics VM (Prometheus, Grafana)"
run gcloud compute instances create "$METRICS_VM" --project="$PROJECT" --zone="$ZONE" \
  --machine-type="$METRICS_MACHINE" --subnet="$SUBNETWORK" --no-address --tags="$METRICS_VM" \
  --no-service-account --no-scopes --image-family=debian-12 --image-project=debian-cloud --boot-disk-size=20GB \
  --metadata-from-file=startup-script=deploy/gcp/metrics-startup.sh,ddb2bt-alerts=deploy/prometheus/alerts.yml,ddb2bt-dashboard=deploy/grafana/dashboard.json
echo "# parameter for the job (flex.sh params ... metrics_pushgateway=...): metrics_pushgateway=http://${METRICS_VM}.${ZONE}.c.${PROJECT}.internal:9091"
echo "# Prometheus (localhost:9090) and Grafana (localhost:3000): gcloud compute ssh ${METRICS_VM} --project=${PROJECT} --zone=${ZONE} --tunnel-through-iap -- -N -L 9090:localhost:9090 -L 3000:localhost:3000"
