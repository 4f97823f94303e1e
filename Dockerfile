# ddb2bt image: the Dataflow custom SDK worker container and, through the Flex
# Template launcher copied in below, the Flex Template launcher image.
# The Beam SDK base image's version must match the pinned apache-beam (2.77).
ARG BEAM_VERSION=2.77.0
ARG PYTHON_VERSION=3.11

FROM gcr.io/dataflow-templates-base/python311-template-launcher-base:latest AS launcher

FROM apache/beam_python${PYTHON_VERSION}_sdk:${BEAM_VERSION}

COPY --from=launcher /opt/google/dataflow/python_template_launcher /opt/google/dataflow/python_template_launcher

WORKDIR /opt/ddb2bt
COPY pyproject.toml README.md ./
COPY transforms/ transforms/
COPY pipeline/ pipeline/
COPY examples/ examples/
RUN pip install --no-cache-dir ".[dataflow]"

# Flex Template: the launcher runs this file with the template's parameters.
ENV FLEX_TEMPLATE_PYTHON_PY_FILE=/opt/ddb2bt/pipeline/cli.py \
    PYTHONPATH=/opt/ddb2bt \
    PYTHONUNBUFFERED=1

# The Beam SDK harness is the entrypoint of the base image (worker mode).
ENTRYPOINT ["/opt/apache/beam/boot"]
