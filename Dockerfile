# ddb2bt image: the Dataflow custom SDK worker container and, with the Flex
# Template launcher copied in, the Flex Template launcher image (one image, so
# the launcher and the workers always run the same code).
# The Beam SDK base image's version must match the pinned apache-beam (2.77.0).
ARG BEAM_VERSION=2.77.0

FROM gcr.io/dataflow-templates-base/python311-template-launcher-base:flex_templates_base_image_release_20251027_RC00 AS launcher

FROM apache/beam_python3.11_sdk:${BEAM_VERSION}

COPY --from=launcher /opt/google/dataflow/python_template_launcher /opt/google/dataflow/python_template_launcher

WORKDIR /opt/ddb2bt
COPY pyproject.toml README.md ./
COPY transforms/ transforms/
COPY pipeline/ pipeline/
COPY examples/ examples/
# Installs this project as the one package ddb2bt (ddb2bt.pipeline,
# ddb2bt.transforms, ddb2bt.examples); its dependency ranges are pinned in
# pyproject.toml.
# The base image (Debian with a C compiler) builds the C row writer
# (transforms/rowwriter_c.c); the second command fails the build without it,
# rather than ship workers that spend ~8 us more CPU on every change.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[dataflow]" \
    && python -c "import ddb2bt.transforms.rowwriter_c"

# AWS credentials, on the launcher VM and the workers alike: botocore runs the
# credential_process of this AWS config file, which exchanges the VM service
# account's Google ID token for temporary credentials of AWS_ROLE_ARN (STS
# AssumeRoleWithWebIdentity; deploy/aws/trust-policy.json says who may). The
# role ARN and the audience are not secrets; no key is ever in the image.
ARG AWS_ROLE_ARN=""
ARG AWS_AUDIENCE="sts.amazonaws.com"
COPY deploy/aws/config /etc/ddb2bt/aws/config
# the config names the program by its path: fail the build if it is not there
RUN test -x /usr/local/bin/ddb2bt-aws-credentials
ENV AWS_CONFIG_FILE=/etc/ddb2bt/aws/config \
    DDB2BT_AWS_ROLE_ARN=${AWS_ROLE_ARN} \
    DDB2BT_AWS_AUDIENCE=${AWS_AUDIENCE}

# The Flex Template launcher runs this file with the template's parameters; the
# file only calls the installed ddb2bt.pipeline.app.cli, so no PYTHONPATH is needed
# (and none is set: the source folders must not shadow the installed package).
ENV FLEX_TEMPLATE_PYTHON_PY_FILE=/opt/ddb2bt/pipeline/app/flex_main.py \
    PYTHONUNBUFFERED=1

# Root stays: the Beam SDK harness (/opt/apache/beam/boot) and the Flex Template
# launcher set up their work directories as root, and Dataflow runs custom SDK
# containers as root; the image holds no secrets (credentials come from the
# worker's service account at run time, see deploy/iam.md).
ENTRYPOINT ["/opt/apache/beam/boot"]
