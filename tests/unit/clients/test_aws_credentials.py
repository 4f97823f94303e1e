"""The image's AWS credential_process (ddb2bt.pipeline.clients.aws_credentials), offline:
a fake GCE metadata server on 127.0.0.1 hands out the ID token, moto's STS
(server mode, from the `stack` fixture) exchanges it, and botocore runs the
program through the AWS config file the image installs (deploy/aws/config).
"""
from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from ddb2bt.pipeline.clients import aws_credentials as ac

ROOT = Path(__file__).resolve().parents[3]
IDENTITY_PATH = "/computeMetadata/v1/instance/service-accounts/default/identity"
SA_UNIQUE_ID = "112233445566778899001"
ACCOUNT = "123456789012"  # moto's default account
ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/ddb2bt-reader"


def _b64(obj) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


class FakeMetadataServer:
    """The GCE metadata server's identity endpoint, on loopback: answers only
    requests carrying ``Metadata-Flavor: Google``, like the real one."""

    def __init__(self, status: int = 200):
        self.status = status
        self.requests: list = []
        self.tokens: list = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                outer.requests.append((url.path, query, self.headers.get("Metadata-Flavor")))
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._answer(403, "Missing Metadata-Flavor:Google header.")
                if url.path != IDENTITY_PATH or outer.status != 200:
                    return self._answer(404 if url.path != IDENTITY_PATH else outer.status, "no")
                token = ".".join([_b64({"alg": "RS256", "typ": "JWT"}), _b64({
                    "iss": "https://accounts.google.com", "aud": query.get("audience"), "azp": SA_UNIQUE_ID,
                    "sub": SA_UNIQUE_ID, "exp": 2_000_000_000}), "c2lnbmF0dXJl"])
                outer.tokens.append(token)
                self._answer(200, token)

            def _answer(self, status: int, body: str):
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{IDENTITY_PATH}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def aws_env(stack, monkeypatch, tmp_path):
    """No AWS credentials in the environment (the stack fixture sets moto's),
    no shared files: only the credential_process can supply them."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    endpoint = f"http://127.0.0.1:{stack.moto_port}"
    monkeypatch.setenv("DDB2BT_AWS_ROLE_ARN", ROLE_ARN)
    monkeypatch.setenv("DDB2BT_STS_ENDPOINT", endpoint)
    monkeypatch.delenv("DDB2BT_AWS_AUDIENCE", raising=False)
    return endpoint


def _program() -> str:
    path = shutil.which("ddb2bt-aws-credentials", path=str(Path(sys.executable).parent))
    assert path, "ddb2bt-aws-credentials is not installed: pip install -e . (deploy/local/setup.sh)"
    return path


def test_the_program_exchanges_the_google_token_for_aws_credentials(aws_env, monkeypatch):
    with FakeMetadataServer() as metadata:
        monkeypatch.setenv("DDB2BT_METADATA_IDENTITY_URL", metadata.url)
        out = subprocess.run([_program()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    creds = json.loads(out.stdout)
    assert creds["Version"] == 1
    assert set(creds) == {"Version", "AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration"}
    assert creds["AccessKeyId"].startswith("ASIA") and creds["SecretAccessKey"] and creds["SessionToken"]
    expires = datetime.strptime(creds["Expiration"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert expires > datetime.now(timezone.utc) + timedelta(minutes=30)
    # the metadata server was asked like the real one wants, for the trust policy's audience
    [(path, query, flavor)] = metadata.requests
    assert (path, query, flavor) == (IDENTITY_PATH, {"audience": "sts.amazonaws.com", "format": "full"}, "Google")
    # nothing secret on stderr (botocore copies it into its exceptions)
    assert out.stderr == ""
    assert metadata.tokens[0] not in out.stdout


def test_botocore_gets_the_role_through_the_images_aws_config(aws_env, monkeypatch, tmp_path):
    """The config file shipped in the image, with only the program's path changed
    to this virtualenv's: a plain boto3 session ends up as the assumed role."""
    shipped = (ROOT / "deploy/aws/config").read_text()
    line = "credential_process = /usr/local/bin/ddb2bt-aws-credentials"
    assert line in shipped.splitlines()
    config = tmp_path / "aws-config"
    config.write_text(shipped.replace("/usr/local/bin/ddb2bt-aws-credentials", _program()))
    with FakeMetadataServer() as metadata:
        monkeypatch.setenv("DDB2BT_METADATA_IDENTITY_URL", metadata.url)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
        session = boto3.Session(region_name="us-east-1")
        frozen = session.get_credentials().get_frozen_credentials()
        identity = session.client("sts", endpoint_url=aws_env).get_caller_identity()
    assert session.get_credentials().method == "custom-process"
    assert frozen.access_key.startswith("ASIA") and frozen.token
    assert identity["Arn"].startswith(f"arn:aws:sts::{ACCOUNT}:assumed-role/ddb2bt-reader/ddb2bt-"), identity
    assert len(metadata.requests) == 1


def test_a_vm_without_a_service_account_gets_a_clear_error(aws_env, monkeypatch):
    with FakeMetadataServer(status=404) as metadata:
        monkeypatch.setenv("DDB2BT_METADATA_IDENTITY_URL", metadata.url)
        out = subprocess.run([_program()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert "HTTP 404" in out.stderr and "--service-account-email" in out.stderr and metadata.url in out.stderr


def test_missing_or_malformed_role_is_named(monkeypatch):
    monkeypatch.delenv("DDB2BT_AWS_ROLE_ARN", raising=False)
    with pytest.raises(ac.CredentialError, match="DDB2BT_AWS_ROLE_ARN"):
        ac.settings_from([])
    with pytest.raises(ac.CredentialError, match="is not an IAM role ARN"):
        ac.settings_from(["--role-arn", "ddb2bt-reader"])
    with pytest.raises(ac.CredentialError, match="900..43200"):
        ac.settings_from(["--role-arn", ROLE_ARN, "--session-seconds", "60"])


def test_an_unreachable_metadata_server_is_retried_then_named():
    calls, sleeps = [], []

    def refused(request, timeout):
        calls.append((request.full_url, request.headers.get("Metadata-flavor"), timeout))
        raise urllib.error.URLError(ConnectionRefusedError(111, "refused"))

    settings = ac.Settings(role_arn=ROLE_ARN, metadata_url="http://127.0.0.1:9/identity")
    with pytest.raises(ac.CredentialError, match=r"unreachable \(ConnectionRefusedError\) after 3 attempts"):
        ac.fetch_identity_token(settings, opener=refused, sleep=sleeps.append)
    assert len(calls) == ac.METADATA_ATTEMPTS and sleeps == [0.5, 1.0]
    assert calls[0][1] == "Google"


class _RefusingSts:
    """STS behind the client's interface, refusing the token (moto trusts every token)."""

    def __init__(self, code: str, token: str):
        self.code, self.token = code, token

    def assume_role_with_web_identity(self, **kwargs):
        assert kwargs["WebIdentityToken"] == self.token and kwargs["RoleArn"] == ROLE_ARN
        raise ClientError({"Error": {"Code": self.code, "Message": f"Not authorized: {self.token}"}},
                          "AssumeRoleWithWebIdentity")


def test_a_refused_token_names_the_trust_policy_and_never_the_token():
    token = "eyJhbGciOi.eyJzdWIiOiIxMTIyIn0.c2ln"
    settings = ac.Settings(role_arn=ROLE_ARN, audience="sts.amazonaws.com", session_name="ddb2bt-w1")
    with pytest.raises(ac.CredentialError) as err:
        ac.exchange_for_aws_credentials(settings, token, client=_RefusingSts("AccessDenied", token))
    message = str(err.value)
    assert "AccessDenied" in message and "trust policy" in message and "'sts.amazonaws.com'" in message
    assert token not in message and "eyJ" not in message


def test_the_program_refuses_to_call_itself(monkeypatch, capsys):
    """A config whose STS client ran the credential_process again would recurse."""
    monkeypatch.setenv(ac._GUARD, "1")
    assert ac.main(["--role-arn", ROLE_ARN]) == 1
    assert "inside itself" in capsys.readouterr().err


def test_the_image_installs_the_program_and_the_config():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY deploy/aws/config /etc/ddb2bt/aws/config" in dockerfile
    assert "AWS_CONFIG_FILE=/etc/ddb2bt/aws/config" in dockerfile
    assert "DDB2BT_AWS_ROLE_ARN=${AWS_ROLE_ARN}" in dockerfile
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'ddb2bt-aws-credentials = "ddb2bt.pipeline.clients.aws_credentials:main"' in pyproject
    cloudbuild = (ROOT / "deploy/dataflow/cloudbuild.yaml").read_text()
    assert '"AWS_ROLE_ARN=${_AWS_ROLE_ARN}"' in cloudbuild


def _render(name: str, *pairs: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "deploy/aws/render_policy.py"), str(ROOT / "deploy/aws" / name),
                          *pairs], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_role_and_its_policies_are_accepted_by_iam_and_the_role_works(aws_env, monkeypatch):
    """The rendered trust, read and export policies pass moto's IAM validation;
    the trust policy pins the token to the service account and the audience;
    the credential process then assumes the role created from them."""
    values = [f"AWS_ACCOUNT={ACCOUNT}", "AWS_REGION=eu-west-1", f"GOOGLE_SA_UNIQUE_ID={SA_UNIQUE_ID}",
              "AUDIENCE=sts.amazonaws.com", "TABLE=Orders", "TABLE=Customers", "EXPORT_BUCKET=exports-bkt",
              "EXPORT_PREFIX=ddb/"]
    trust = _render("trust-policy.json", *values)
    [statement] = trust["Statement"]
    assert statement["Principal"] == {"Federated": "accounts.google.com"}
    assert statement["Condition"]["StringEquals"] == {"accounts.google.com:aud": SA_UNIQUE_ID,
                                                      "accounts.google.com:sub": SA_UNIQUE_ID,
                                                      "accounts.google.com:oaud": "sts.amazonaws.com"}
    read = _render("permissions-policy.json", *values)
    actions = {a for s in read["Statement"] for a in s["Action"]}
    assert actions == {"dynamodb:DescribeTable", "dynamodb:Scan", "dynamodb:DescribeStream",
                       "dynamodb:GetShardIterator", "dynamodb:GetRecords", "dynamodb:ListStreams",
                       "s3:GetObject", "s3:ListBucket"}
    assert not any(a.startswith(("dynamodb:Put", "dynamodb:Update", "dynamodb:Delete", "s3:Put")) for a in actions)
    export = _render("export-policy.json", *values)
    scan_only = _render("permissions-policy.json", *values[:6])
    assert not any(s["Action"][0].startswith("s3:") for s in scan_only["Statement"])

    iam = boto3.client("iam", endpoint_url=aws_env, region_name="us-east-1", aws_access_key_id="admin",
                       aws_secret_access_key="admin")
    iam.create_role(RoleName="ddb2bt-reader", AssumeRolePolicyDocument=json.dumps(trust))
    for name, doc in (("ddb2bt-read", read), ("ddb2bt-export", export)):
        iam.create_policy(PolicyName=f"{name}-check", PolicyDocument=json.dumps(doc))  # validates the grammar
        iam.put_role_policy(RoleName="ddb2bt-reader", PolicyName=name, PolicyDocument=json.dumps(doc))
    with FakeMetadataServer() as metadata:
        monkeypatch.setenv("DDB2BT_METADATA_IDENTITY_URL", metadata.url)
        out = subprocess.run([_program()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["Version"] == 1
    iam.delete_role_policy(RoleName="ddb2bt-reader", PolicyName="ddb2bt-read")
    iam.delete_role_policy(RoleName="ddb2bt-reader", PolicyName="ddb2bt-export")
    iam.delete_role(RoleName="ddb2bt-reader")


def test_render_names_a_missing_value():
    out = subprocess.run([sys.executable, str(ROOT / "deploy/aws/render_policy.py"),
                          str(ROOT / "deploy/aws/trust-policy.json"), "GOOGLE_SA_UNIQUE_ID=1"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "no value for AUDIENCE" in out.stderr
