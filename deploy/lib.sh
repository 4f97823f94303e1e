# Shared by the deploy scripts (sourced, not run): --dry-run support.
# shellcheck shell=bash

DRY_RUN="${DRY_RUN:-0}"

# Print a command so that it can be pasted back into a shell: words made only of
# safe characters as they are, anything else in single quotes.
quote() {
  local out="" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
      out+="$a "
    else
      out+="'${a//\'/\'\\\'\'}' "
    fi
  done
  printf '%s\n' "${out% }"
}

# Run a command, or with --dry-run only print it (exactly what would run).
run() {
  if [ "$DRY_RUN" = 1 ]; then
    quote "$@"
  else
    "$@"
  fi
}

# The script's leading comment block (its usage), without the '#'.
header() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# The deploy guide's aws commands need the AWS CLI v2 (v1 lacks some of their
# options and prints differently). A CLI of another major version is refused,
# --dry-run included; none at all is refused for a real run and noted in a dry run.
require_aws_cli_v2() {
  local version
  if ! command -v aws > /dev/null 2>&1; then
    [ "$DRY_RUN" = 1 ] || die "the AWS CLI v2 (aws) is not on PATH: install it (https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html)"
    echo "$(basename "$0"): note: no aws on PATH; the commands below need the AWS CLI v2" >&2
    return 0
  fi
  version="$(aws --version 2>&1 | head -n 1)"
  case "$version" in
    aws-cli/2.*) ;;
    *) die "needs the AWS CLI v2, found '${version%% *}': install v2 (https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html)" ;;
  esac
}
