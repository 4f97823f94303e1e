#!/usr/bin/env bash
# Runs as root on the metrics VM at every boot (deploy/gcp/metrics.sh passes it as
# the VM's startup-script): the Pushgateway on :9091 for the workers, Prometheus
# and Grafana on 127.0.0.1 only. The alert rules and the dashboard come from the
# VM's metadata (ddb2bt-alerts, ddb2bt-dashboard): to change them, update the
# metadata (gcloud compute instances add-metadata ... --metadata-from-file=...)
# and reboot the VM, or edit the files under /opt/ddb2bt and restart the container.
set -euo pipefail
attr() {
  curl -fsS -H 'Metadata-Flavor: Google' "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}
command -v docker > /dev/null || { apt-get update -q && apt-get install -y -q docker.io; }
base=/opt/ddb2bt
mkdir -p "$base/prometheus" "$base/grafana/datasources" "$base/grafana/dashboards" "$base/grafana/json"
attr ddb2bt-alerts > "$base/prometheus/alerts.yml"
attr ddb2bt-dashboard > "$base/grafana/json/ddb2bt.json"
cat > "$base/prometheus/prometheus.yml" <<'YAML'
global: {scrape_interval: 30s, evaluation_interval: 30s}
rule_files: [/etc/prometheus/alerts.yml]
scrape_configs:
  - job_name: pushgateway
    honor_labels: true  # keep the job and instance labels the workers pushed
    static_configs: [{targets: ["pushgateway:9091"]}]
YAML
cat > "$base/grafana/datasources/prometheus.yml" <<'YAML'
apiVersion: 1
datasources: [{name: Prometheus, type: prometheus, access: proxy, url: "http://prometheus:9090", isDefault: true}]
YAML
cat > "$base/grafana/dashboards/ddb2bt.yml" <<'YAML'
apiVersion: 1
providers: [{name: ddb2bt, type: file, options: {path: /var/lib/grafana/json}}]
YAML
docker network inspect ddb2bt > /dev/null 2>&1 || docker network create ddb2bt
docker rm -f pushgateway prometheus grafana > /dev/null 2>&1 || true
docker run -d --restart=always --name pushgateway --network ddb2bt -p 9091:9091 prom/pushgateway:v1.9.0
docker run -d --restart=always --name prometheus --network ddb2bt -p 127.0.0.1:9090:9090 \
  -v "$base/prometheus:/etc/prometheus:ro" -v prometheus-data:/prometheus prom/prometheus:v2.53.1 \
  --config.file=/etc/prometheus/prometheus.yml --storage.tsdb.path=/prometheus --storage.tsdb.retention.time=30d
docker run -d --restart=always --name grafana --network ddb2bt -p 127.0.0.1:3000:3000 \
  -v "$base/grafana/datasources:/etc/grafana/provisioning/datasources:ro" \
  -v "$base/grafana/dashboards:/etc/grafana/provisioning/dashboards:ro" \
  -v "$base/grafana/json:/var/lib/grafana/json:ro" grafana/grafana:11.1.0
