#!/usr/bin/env bash
# Runs the Python and Node examples' tests against DATABASE_URL (a database where
# `CREATE EXTENSION inbox` was run): installs their pinned drivers (PyPI into a virtualenv,
# npm into node_modules, both inside examples/), then checks in the database that every effect
# was written exactly once. Usage: DATABASE_URL=postgres://... examples/run.sh [python|node]...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
: "${DATABASE_URL:?set DATABASE_URL to a database with the inbox extension}"
export DATABASE_URL

run_python() {
  local python="${PYTHON:-python3}" venv=python/.venv
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r python/requirements.txt
  (cd python && .venv/bin/python -m pytest -p no:cacheprovider -q test_inbox_example.py)
}

run_node() {
  (cd node && npm ci --no-audit --no-fund --loglevel=error && npm test --silent)
}

languages=("$@")
((${#languages[@]})) || languages=(python node)
for language in "${languages[@]}"; do
  case "$language" in
    python) run_python ;;
    node) run_node ;;
    *) echo "unknown example: $language (python or node)" >&2; exit 2 ;;
  esac
done
