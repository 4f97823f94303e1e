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
