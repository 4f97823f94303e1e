"""A real Prometheus server (Debian's /usr/bin/prometheus) for the alert tests:
on 127.0.0.1, a free port, scraping every second and evaluating the shipped
deploy/prometheus/alerts.yml every second, in a copy where only the `for:`
durations are shortened (every threshold and window is the shipped one). It
scrapes a job's --metrics-port as the scrape job "ddb2bt" and/or a
Pushgateway with honor_labels, as docs/operations.md configures them.

No Prometheus binary fails the test (deploy/local/setup.sh installs it): the
alerts are what is under test."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Optional

import yaml

from tests.conftest import ROOT, wait_for

RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboard.json"
PROMETHEUS = "/usr/bin/prometheus"
SHORT_FOR = "3s"  # every `for:` of the copy (the shipped ones are minutes)
STEP_S = 1  # scrape and evaluation interval


def shortened_rules(dest: Path, short_for: str = SHORT_FOR) -> Path:
    """The shipped rules with only their `for:` durations replaced."""
    text = RULES.read_text()
    copy = re.sub(r"^(\s+for:) \S+$", rf"\1 {short_for}", text, flags=re.M)
    shipped, shortened = yaml.safe_load(text), yaml.safe_load(copy)
    for a, b in zip(shipped["groups"][0]["rules"], shortened["groups"][0]["rules"]):
        assert {k: v for k, v in a.items() if k != "for"} == {k: v for k, v in b.items() if k != "for"}
    dest.write_text(copy)
    return dest


def free_port() -> int:
    from ddb2bt.pipeline.local.local_stack import free_port as free

    return free()


class Prometheus:
    def __init__(self, workdir: Path, targets: tuple = (), pushgateway: Optional[str] = None) -> None:
        binary = shutil.which("prometheus") or PROMETHEUS
        if not Path(binary).exists():
            raise AssertionError("prometheus is not installed (Debian package prometheus; deploy/local/setup.sh "
                                 "installs it): the alert tests need a real Prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        scrape = []
        if targets:
            scrape.append({"job_name": "ddb2bt", "static_configs": [{"targets": list(targets)}]})
        if pushgateway:
            scrape.append({"job_name": "pushgateway", "honor_labels": True,
                           "static_configs": [{"targets": [pushgateway]}]})
        rules = shortened_rules(workdir / "alerts.yml")
        config = {"global": {"scrape_interval": f"{STEP_S}s", "evaluation_interval": f"{STEP_S}s",
                             "scrape_timeout": f"{STEP_S}s"},
                  "rule_files": [str(rules)], "scrape_configs": scrape}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
        self.close()
        raise AssertionError(f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get(self, path: str, **params) -> dict:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: Optional[float] = None) -> list:
        """[(labels, value)] of an instant query."""
        data = self._get("/api/v1/query", query=expr, **({"time": f"{at:.3f}"} if at else {}))
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query_range(self, expr: str, start: float, end: float) -> list:
        """[(labels, [(t, value)])]."""
        data = self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1")
        return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]]

    def alerts(self, name: str, state: str = "firing") -> list:
        return [a for a in self._get("/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == name and a["state"] == state]

    def wait(self, predicate, timeout: float, what: str, step: float = 0.5):
        return wait_for(predicate, timeout, what, step,
                        lambda: f"; firing: {[a['labels'] for a in self._get('/api/v1/alerts')['alerts']]}")

    def wait_firing(self, name: str, timeout: float) -> list:
        return self.wait(lambda: self.alerts(name), timeout, f"{name} to fire")

    def wait_cleared(self, name: str, timeout: float) -> None:
        self.wait(lambda: not self.alerts(name) and not self.alerts(name, "pending"), timeout, f"{name} to clear")

    def wait_scraped(self, expr: str, timeout: float = 60) -> list:
        return self.wait(lambda: self.query(expr), timeout, f"{expr} in Prometheus")

    def firing_names(self) -> set:
        return {a["labels"]["alertname"] for a in self._get("/api/v1/alerts")["alerts"] if a["state"] == "firing"}


def dashboard_queries(table: str) -> list:
    """(panel title, PromQL) of every query of the Grafana dashboard, for ``table``."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"].replace("$table", re.escape(table))))
    return out


def check_dashboard(prom: Prometheus, table: str, no_data_expected: tuple = ()) -> dict:
    """Every dashboard query returns data, none of it negative (quantiles of a
    window without a change are NaN: reported, not failed); the queries in
    ``no_data_expected`` (substrings) return nothing (e.g. the push freshness on
    the scrape path). Returns {query: values}."""
    values, wrong = {}, []
    for title, expr in dashboard_queries(table):
        result = prom.query(expr)
        if any(s in expr for s in no_data_expected):
            if result != []:
                wrong.append(f"{title}: {expr} should have no data here, got {result}")
            continue
        vals = [v for _, v in result]
        if not result:
            wrong.append(f"{title}: {expr} returned No data")
        elif not all(v >= 0 or (math.isnan(v) and ("histogram_quantile" in expr or " / " in expr)) for v in vals):
            wrong.append(f"{title}: {expr} returned {vals}")
        values[expr] = vals
    assert not wrong, "\n".join(wrong)
    return values
