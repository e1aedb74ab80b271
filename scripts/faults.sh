#!/usr/bin/env bash
# The fault suite: every case of docs/reliability.md on real PostgreSQL over real
# connections, one row per case, closing with "N passed, M failed" (non-zero exit on a failure).
#
#   ./scripts/faults.sh [--full] [--cases 1,5,13] [--docs] [--no-install]
#
# The default profile is CI's (the full counts where they fit in CI's time, fewer jobs and
# kills elsewhere); --full runs the full counts everywhere. The table is written to
# target/faults/latest.md; --docs also puts it into docs/reliability.md. --no-install skips the
# toolchain check and the extension's build (scripts/test.sh has done both). Cases that stop or
# crash a server start throwaway clusters of their own; the others use the PostgreSQL that
# scripts/lib.sh finds or starts (INBOX_PG_URL when a caller already did).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

args=()
docs=0
install=1
while (($#)); do
  case "$1" in
    --docs) docs=1 ;;
    --no-install) install=0 ;;
    --full | --quick) args+=("$1") ;;
    --cases)
      args+=("$1" "${2:?--cases needs a list}")
      shift
      ;;
    *)
      echo "usage: $0 [--full] [--cases 1,5,13] [--docs] [--no-install]" >&2
      exit 2
      ;;
  esac
  shift
done

start=$SECONDS
on_exit 'echo "fault suite time: $((SECONDS - start))s"'

if ((install)); then
  banner "toolchain"
  ensure_toolchain
  banner "install the extension"
  install_extension ci
fi
# Case 8 runs its workers under libfaketime.
if ! dpkg -s libfaketime 2>/dev/null | grep -qx 'Status: install ok installed'; then
  echo "installing faketime"
  apt_install faketime
fi

if [[ -z "${INBOX_PG_URL:-}" ]]; then
  banner "PostgreSQL for the fault suite"
  ensure_postgres
fi
url="$(fresh_database inbox_faults)"

banner "build the fault suite"
# The binary as the workspace's test build makes it (scripts/test.sh has built it already).
cargo test "${CI_TESTS[@]}" --no-run

banner "fault suite (against $url)"
mkdir -p target/faults
# The throwaway clusters of the cases go here, so that an interrupted run leaves none running.
faults_tmp="$(mktemp -d /tmp/inbox-faults.XXXXXX)"
chmod 755 "$faults_tmp"
on_exit "for dir in '$faults_tmp'/*/; do [[ -d \$dir ]] && remove_pg_dir \$dir; done; rm -rf '$faults_tmp'"
status=0
INBOX_FAULTS_TMP="$faults_tmp" INBOX_TEST_DATABASE_URL="$url" INBOX_PG_CONFIG="$PG_CONFIG" \
  target/ci/faults "${args[@]}" --markdown target/faults/latest.md || status=$?

if ((docs)) && [[ -f target/faults/latest.md ]]; then
  # Replaces what lies between the two markers of docs/reliability.md with the new table.
  awk -v table=target/faults/latest.md '
    /<!-- faults:begin -->/ { print; while ((getline line < table) > 0) print line; skip = 1; next }
    /<!-- faults:end -->/ { skip = 0 }
    !skip { print }
  ' docs/reliability.md >docs/reliability.md.new
  mv docs/reliability.md.new docs/reliability.md
  echo "docs/reliability.md updated"
fi
exit "$status"
