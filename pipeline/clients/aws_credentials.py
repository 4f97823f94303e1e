"""AWS credentials for Dataflow workers from their Google identity (workload
identity federation; docs/deploy-dataflow.md#aws-credentials-on-the-workers).

botocore runs this program as the ``credential_process`` of the AWS config file
the image installs (``deploy/aws/config``, ``AWS_CONFIG_FILE``). Each run:

1. asks the GCE metadata server for an ID token of the VM's service account,
   with the configured audience (the Flex Template launcher VM and the workers
   run as the same service account, so both get the same AWS role);
2. exchanges it with STS ``AssumeRoleWithWebIdentity`` (an unsigned call: it
   needs no AWS credentials) for temporary credentials of the role;
3. prints them as credential_process JSON (``Version`` 1) on stdout.

botocore caches the result and runs the program again shortly before
``Expiration``, so a long streaming job never holds a credential older than the
session duration. Nothing here prints or logs a token or a credential: errors
(on stderr, which botocore copies into its exception) name the step, the
endpoint and the HTTP status or AWS error code only.

Configuration (environment, baked into the image by ``docker build --build-arg
AWS_ROLE_ARN=…``; each also a command-line option for trying it by hand):
``DDB2BT_AWS_ROLE_ARN`` (required), ``DDB2BT_AWS_AUDIENCE``,
``DDB2BT_METADATA_IDENTITY_URL``, ``DDB2BT_STS_ENDPOINT``, ``DDB2BT_STS_REGION``,
``DDB2BT_AWS_SESSION_SECONDS``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional

__all__ = ["Settings", "fetch_identity_token", "exchange_for_aws_credentials", "credential_process_output", "main"]

METADATA_IDENTITY_URL = ("http://metadata.google.internal/computeMetadata/v1/instance/"
                         "service-accounts/default/identity")
# The token's `aud` claim; the role's trust policy checks it (accounts.google.com:oaud).
# Any string works as long as both sides agree; this one says what the token is for.
DEFAULT_AUDIENCE = "sts.amazonaws.com"
# The role's default maximum session is 1 h; botocore refreshes before expiry.
DEFAULT_SESSION_SECONDS = 3600
# STS accepts 900 s .. 43200 s (and at most the role's MaxSessionDuration).
MIN_SESSION_SECONDS, MAX_SESSION_SECONDS = 900, 43200
DEFAULT_STS_REGION = "us-east-1"
# The metadata server answers in milliseconds on a VM; a few short tries cover
# its rare restarts without keeping botocore (and the record reader) waiting long.
METADATA_TIMEOUT_S = 5.0
METADATA_ATTEMPTS = 3
METADATA_BACKOFF_S = 0.5
# STS: botocore's "standard" retry mode retries throttling and 5xx itself.
STS_ATTEMPTS = 3
STS_CONNECT_TIMEOUT_S = 5.0
STS_READ_TIMEOUT_S = 10.0
# Set while this program runs: an AWS config that (wrongly) made the STS client
# call this program again would otherwise recurse without end.
_GUARD = "DDB2BT_AWS_CREDENTIAL_PROCESS_RUNNING"
_SESSION_NAME_CHARS = re.compile(r"[^\w+=,.@-]")
_ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::[0-9]{12}:role/[\w+=,.@/-]+$")


class CredentialError(Exception):
    """A failure with a message fit for stderr: no token, no credential."""


@dataclass(frozen=True)
class Settings:
    role_arn: str
    audience: str = DEFAULT_AUDIENCE
    metadata_url: str = METADATA_IDENTITY_URL
    sts_endpoint: Optional[str] = None  # None: botocore's endpoint for sts_region
    sts_region: str = DEFAULT_STS_REGION
    session_seconds: int = DEFAULT_SESSION_SECONDS
    session_name: str = ""


def session_name(host: Optional[str] = None) -> str:
    """``ddb2bt-<host>``: CloudTrail shows which worker assumed the role."""
    name = _SESSION_NAME_CHARS.sub("-", f"ddb2bt-{host or socket.gethostname()}")
    return name[:64]


def fetch_identity_token(settings: Settings, opener: Callable = urllib.request.urlopen,
                         sleep: Callable[[float], None] = time.sleep) -> str:
    """The VM service account's ID token for ``settings.audience``."""
    query = urllib.parse.urlencode({"audience": settings.audience, "format": "full"})
    request = urllib.request.Request(f"{settings.metadata_url}?{query}", headers={"Metadata-Flavor": "Google"})
    last = ""
    for attempt in range(1, METADATA_ATTEMPTS + 1):
        try:
            with opener(request, timeout=METADATA_TIMEOUT_S) as response:
                token = response.read().decode("ascii", "replace").strip()
            if token.count(".") != 2:
                raise CredentialError(f"the metadata server at {settings.metadata_url} returned no ID token "
                                      "(not a JWT)")
            return token
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise CredentialError(f"the metadata server at {settings.metadata_url} has no service account for "
                                      "this VM (HTTP 404): launch the job with --service-account-email") from None
            if exc.code < 500:
                raise CredentialError(f"the metadata server at {settings.metadata_url} refused the ID token "
                                      f"request (HTTP {exc.code})") from None
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            last = f"unreachable ({type(reason).__name__})"
        if attempt < METADATA_ATTEMPTS:
            sleep(METADATA_BACKOFF_S * attempt)
    raise CredentialError(f"cannot get an ID token from the metadata server at {settings.metadata_url}: {last} "
                          f"after {METADATA_ATTEMPTS} attempts (is this a GCE/Dataflow VM?)")


def _sts_client(settings: Settings):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    # UNSIGNED: AssumeRoleWithWebIdentity needs no credentials, and botocore then
    # resolves none, so it never runs this credential_process from inside itself.
    config = Config(signature_version=UNSIGNED, retries={"max_attempts": STS_ATTEMPTS, "mode": "standard"},
                    connect_timeout=STS_CONNECT_TIMEOUT_S, read_timeout=STS_READ_TIMEOUT_S)
    return boto3.session.Session().client("sts", region_name=settings.sts_region,
                                          endpoint_url=settings.sts_endpoint, config=config)


def exchange_for_aws_credentials(settings: Settings, token: str, client=None) -> dict:
    """STS AssumeRoleWithWebIdentity → the ``Credentials`` of the response."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = client or _sts_client(settings)
    try:
        response = client.assume_role_with_web_identity(
            RoleArn=settings.role_arn, RoleSessionName=settings.session_name or session_name(),
            WebIdentityToken=token, DurationSeconds=settings.session_seconds)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        hint = ""
        if code in ("AccessDenied", "InvalidIdentityToken"):
            hint = (f"; check the role's trust policy: accounts.google.com:aud and :sub must be the service "
                    f"account's unique id, accounts.google.com:oaud must be {settings.audience!r} "
                    "(deploy/aws/trust-policy.json)")
        raise CredentialError(f"STS AssumeRoleWithWebIdentity for {settings.role_arn} failed: {code}{hint}") from None
    except BotoCoreError as exc:
        raise CredentialError(f"STS AssumeRoleWithWebIdentity for {settings.role_arn} failed: "
                              f"{type(exc).__name__}") from None
    return response["Credentials"]


def credential_process_output(credentials: dict) -> str:
    """The JSON botocore (and every AWS SDK) expects from a credential_process."""
    expiration = credentials["Expiration"]
    if isinstance(expiration, datetime):
        expiration = expiration.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({"Version": 1, "AccessKeyId": credentials["AccessKeyId"],
                       "SecretAccessKey": credentials["SecretAccessKey"],
                       "SessionToken": credentials["SessionToken"], "Expiration": expiration})


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="ddb2bt-aws-credentials", allow_abbrev=False,
        description="Print AWS credentials for this VM's Google service account (AWS credential_process: "
                    "metadata-server ID token → STS AssumeRoleWithWebIdentity). Run by botocore through the "
                    "AWS config file in the ddb2bt image; see docs/deploy-dataflow.md.")
    p.add_argument("--role-arn", default=env("DDB2BT_AWS_ROLE_ARN"),
                   help="the AWS role to assume (env DDB2BT_AWS_ROLE_ARN, set at image build time)")
    p.add_argument("--audience", default=env("DDB2BT_AWS_AUDIENCE", DEFAULT_AUDIENCE),
                   help="the ID token's audience, as in the role's trust policy (default %(default)s)")
    p.add_argument("--metadata-url", default=env("DDB2BT_METADATA_IDENTITY_URL", METADATA_IDENTITY_URL),
                   help="the metadata server's identity endpoint (default: the GCE metadata server)")
    p.add_argument("--sts-endpoint", default=env("DDB2BT_STS_ENDPOINT"),
                   help="STS endpoint URL (default: botocore's for --sts-region)")
    p.add_argument("--sts-region", default=env("DDB2BT_STS_REGION", DEFAULT_STS_REGION))
    p.add_argument("--session-seconds", type=int,
                   default=int(env("DDB2BT_AWS_SESSION_SECONDS", DEFAULT_SESSION_SECONDS)),
                   help="lifetime of the AWS session (default %(default)s; at most the role's maximum)")
    return p


def settings_from(argv: Optional[list]) -> Settings:
    args = _parser().parse_args(argv)
    if not args.role_arn:
        raise CredentialError("no role: set DDB2BT_AWS_ROLE_ARN (docker build --build-arg AWS_ROLE_ARN=…) "
                              "or pass --role-arn")
    if not _ROLE_ARN.match(args.role_arn):
        raise CredentialError(f"{args.role_arn!r} is not an IAM role ARN (arn:aws:iam::123456789012:role/NAME)")
    if not MIN_SESSION_SECONDS <= args.session_seconds <= MAX_SESSION_SECONDS:
        raise CredentialError(f"--session-seconds must be within {MIN_SESSION_SECONDS}..{MAX_SESSION_SECONDS}")
    return Settings(role_arn=args.role_arn, audience=args.audience, metadata_url=args.metadata_url,
                    sts_endpoint=args.sts_endpoint or None, sts_region=args.sts_region,
                    session_seconds=args.session_seconds, session_name=session_name())


def main(argv: Optional[list] = None) -> int:
    if os.environ.get(_GUARD):
        print("ddb2bt-aws-credentials: called from inside itself (an AWS config loop); giving up", file=sys.stderr)
        return 1
    os.environ[_GUARD] = "1"
    try:
        settings = settings_from(argv)
        token = fetch_identity_token(settings)
        print(credential_process_output(exchange_for_aws_credentials(settings, token)))
        return 0
    except CredentialError as exc:
        print(f"ddb2bt-aws-credentials: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
