#!/usr/bin/env bash
# One-time (idempotent) local set-up: a virtualenv in .venv with ddb2bt and its
# test tools, ministack (the default local AWS emulator) in .venv-ministack, and a
# check that the Bigtable emulator is installed.
#   deploy/local/setup.sh && .venv/bin/ddb2bt demo
#   deploy/local/setup.sh && .venv/bin/python -m pytest
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# uv (from PyPI) installs the very same resolution as pip (compared with pip freeze)
# faster: ~20 s instead of ~80 s on a 2-core machine with nothing cached, ~50 s
# with the bytecode compiled (below). pip stays the
# fallback, and the way for a machine whose pip config names a private index or
# certificates (uv does not read pip.conf): DDB2BT_SETUP_PIP=1 forces it.
# --compile-bytecode as pip does: with PYTHONDONTWRITEBYTECODE set (as on some CI
# machines) nothing is ever cached later, and every ddb2bt process would compile
# Beam & co. again (~3.5 s of CPU a start instead of ~0.1).
install() {  # install <venv> <requirement>...
  local venv="$1"; shift
  if [ "${DDB2BT_SETUP_PIP:-}" != 1 ] && { [ -x .venv/bin/uv ] || .venv/bin/python -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1; } \
     && .venv/bin/uv pip install --quiet --native-tls --compile-bytecode --python "$venv/bin/python" "$@"; then
    return 0
  fi
  [ "${DDB2BT_SETUP_PIP:-}" = 1 ] || echo "setup: uv was not usable here; installing with pip (slower)"
  "$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$venv/bin/python" -m ensurepip --upgrade >/dev/null
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}
echo "setup: installing ddb2bt and its dependencies (first time: ~1 min with uv, ~2 min with pip)"
install .venv -e ".[dev,dataflow]"

# ministack, the default local AWS emulator, pins one botocore release exactly: in
# .venv it would hold ddb2bt's boto3 back, so it gets a virtualenv of its own, which
# the local stack finds next to .venv (docs/development.md, "Two AWS emulators").
MINISTACK_REQUIREMENT="$(.venv/bin/python -c 'from ddb2bt.pipeline.local.local_stack import MINISTACK_REQUIREMENT as r; print(r)')"
if [ ! -x .venv-ministack/bin/python ]; then
  echo "setup: creating .venv-ministack for ministack (the default local AWS emulator)"
  # uv makes a virtualenv in a tenth of a second (venv's ensurepip takes ~5 s);
  # ministack's needs no pip of its own
  if [ "${DDB2BT_SETUP_PIP:-}" != 1 ] && [ -x .venv/bin/uv ]; then
    .venv/bin/uv venv --quiet --python "$(command -v "$PYTHON")" .venv-ministack
  else
    "$PYTHON" -m venv .venv-ministack
  fi
fi
install .venv-ministack "$MINISTACK_REQUIREMENT"
version_in() {  # version_in <venv> <distribution>: its installed version, or nothing
  "$1/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$2" 2>/dev/null || true
}
if [ -n "$(version_in .venv ministack)" ]; then
  # an earlier set-up put ministack in .venv: take it out and let boto3 move on again
  .venv/bin/python -m pip uninstall --quiet --yes ministack
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade boto3 botocore
fi
echo "setup: ministack $(version_in .venv-ministack ministack) in .venv-ministack; boto3 $(version_in .venv boto3) in .venv"

# The Bigtable emulator ships with the Google Cloud CLI. Find it the way the
# product does; if it is missing, try the Debian package, else explain.
if ! .venv/bin/python -c "from ddb2bt.pipeline.local.local_stack import find_cbtemulator; find_cbtemulator()" 2>/dev/null; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: cbtemulator not found; trying apt-get install google-cloud-cli-bigtable-emulator"
    apt-get install -y -qq google-cloud-cli-bigtable-emulator >/dev/null 2>&1 || true
  fi
  .venv/bin/python -c "from ddb2bt.pipeline.local.local_stack import find_cbtemulator; print('setup: cbtemulator at', find_cbtemulator())"
else
  .venv/bin/python -c "from ddb2bt.pipeline.local.local_stack import find_cbtemulator; print('setup: cbtemulator at', find_cbtemulator())"
fi
# promtool (Debian package "prometheus") validates and unit-tests the alert rules;
# the Prometheus server of the same package runs them in the alert tests
# (tests/e2e/test_alerts_prometheus.py: a real Prometheus scraping a running job).
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing promtool (Debian package prometheus)"
    # Never let the package start a Prometheus server: we only need the tool.
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || true
    rm -f /usr/sbin/policy-rc.d
  fi
  command -v promtool >/dev/null 2>&1 && echo "setup: promtool $(promtool --version 2>&1 | head -1 | cut -d' ' -f3)" \
    || echo "setup: WARNING promtool not installed (apt-get install prometheus); the alert-rule tests will fail"
  command -v prometheus >/dev/null 2>&1 && echo "setup: prometheus installed" \
    || echo "setup: WARNING prometheus not installed (apt-get install prometheus); the alert tests will fail"
fi
# The Pushgateway (Debian package "prometheus-pushgateway"): the metrics-freshness
# test runs the real gateway on 127.0.0.1, as Dataflow workers push to one.
if ! command -v prometheus-pushgateway >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing prometheus-pushgateway (Debian package)"
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus-pushgateway >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 || true
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus-pushgateway >/dev/null 2>&1 || true; }
    rm -f /usr/sbin/policy-rc.d
  fi
  command -v prometheus-pushgateway >/dev/null 2>&1 && echo "setup: prometheus-pushgateway installed" \
    || echo "setup: WARNING prometheus-pushgateway not installed (apt-get install prometheus-pushgateway); the Pushgateway test will fail"
fi
echo "setup: done"
