#!/usr/bin/env bash
# The AWS side of a ddb2bt deployment: one IAM role the Dataflow launcher VM and
# workers assume with their Google identity (no AWS key anywhere), read-only on
# the source tables, their streams and (optionally) an export prefix.
#
#   deploy/aws/setup.sh [--dry-run] [--with-export-permissions]
#
# --dry-run                  print the exact aws commands instead of running them
# --with-export-permissions  also let the role take DynamoDB exports into
#                            EXPORT_BUCKET/EXPORT_PREFIX (deploy/aws/export-policy.json);
#                            by default exports are an operator's action, not the workers'
#
# Environment:
#   AWS_ACCOUNT          the 12-digit account holding the tables
#   AWS_REGION           the tables' region
#   TABLES               the source DynamoDB tables, separated by spaces
#   GOOGLE_SA_UNIQUE_ID  the worker service account's unique id (deploy/gcp/setup.sh prints it;
#                        gcloud iam service-accounts describe SA --format='value(uniqueId)')
#   AUDIENCE             the ID token's audience (default sts.amazonaws.com, as in the image)
#   ROLE_NAME            default ddb2bt-reader
#   EXPORT_BUCKET, EXPORT_PREFIX  only when back-filling from an export (s3://EXPORT_BUCKET/EXPORT_PREFIX)
#
# Runs with the credentials of an AWS administrator, with the AWS CLI v2 (another
# version is refused, --dry-run included). The role trusts
# accounts.google.com, AWS's built-in Google identity provider: no OIDC provider
# to create. Its conditions pin the token to one service account (aud = azp and
# sub = its unique id) and to the audience (oaud).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/lib.sh
. deploy/lib.sh

with_export=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --with-export-permissions) with_export=1 ;;
    -h|--help) header; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
  esac
done

: "${AWS_ACCOUNT:?set AWS_ACCOUNT}" "${AWS_REGION:?set AWS_REGION}" "${TABLES:?set TABLES (space-separated)}"
: "${GOOGLE_SA_UNIQUE_ID:?set GOOGLE_SA_UNIQUE_ID (deploy/gcp/setup.sh prints it)}"
AUDIENCE="${AUDIENCE:-sts.amazonaws.com}"
ROLE_NAME="${ROLE_NAME:-ddb2bt-reader}"
[[ "$AWS_ACCOUNT" =~ ^[0-9]{12}$ ]] || die "AWS_ACCOUNT must be 12 digits, got '$AWS_ACCOUNT'"
[[ "$GOOGLE_SA_UNIQUE_ID" =~ ^[0-9]{10,30}$ ]] || die "GOOGLE_SA_UNIQUE_ID is the service account's numeric unique id, not its email"
if [ "$with_export" = 1 ] && [ -z "${EXPORT_BUCKET:-}" ]; then
  die "--with-export-permissions needs EXPORT_BUCKET (and EXPORT_PREFIX)"
fi

require_aws_cli_v2

values=(AWS_ACCOUNT="$AWS_ACCOUNT" AWS_REGION="$AWS_REGION" GOOGLE_SA_UNIQUE_ID="$GOOGLE_SA_UNIQUE_ID" AUDIENCE="$AUDIENCE")
read -r -a tables <<< "$TABLES"
for t in "${tables[@]}"; do values+=(TABLE="$t"); done
[ -n "${EXPORT_BUCKET:-}" ] && values+=(EXPORT_BUCKET="$EXPORT_BUCKET")
[ -n "${EXPORT_PREFIX:-}" ] && values+=(EXPORT_PREFIX="$EXPORT_PREFIX")
render() { python3 deploy/aws/render_policy.py "$1" "${values[@]}"; }
trust="$(render deploy/aws/trust-policy.json)"
read_policy="$(render deploy/aws/permissions-policy.json)"

if [ "$DRY_RUN" != 1 ] && aws iam get-role --role-name "$ROLE_NAME" >/dev/null 2>&1; then
  run aws iam update-assume-role-policy --role-name "$ROLE_NAME" --policy-document "$trust"
else
  run aws iam create-role --role-name "$ROLE_NAME" --max-session-duration 3600 \
    --description "ddb2bt Dataflow workers (Google service account ${GOOGLE_SA_UNIQUE_ID})" \
    --assume-role-policy-document "$trust"
fi
run aws iam put-role-policy --role-name "$ROLE_NAME" --policy-name ddb2bt-read --policy-document "$read_policy"
if [ "$with_export" = 1 ]; then
  run aws iam put-role-policy --role-name "$ROLE_NAME" --policy-name ddb2bt-export \
    --policy-document "$(render deploy/aws/export-policy.json)"
fi
echo "# role for the image (deploy/dataflow/flex.sh build): AWS_ROLE_ARN=arn:aws:iam::${AWS_ACCOUNT}:role/${ROLE_NAME}"
