#!/usr/bin/env bash
# Build the documentation site (mkdocs.yml) into build/site in strict mode: any warning fails the
# build, with the whole log printed. Needs the `docs` dependency group and PyTorch (the API page of
# bsmm.torch imports it: its convolution layers' docstrings are made at import) in $PYTHON:
# `pip install -e '.[torch]' --group docs` (pip 25.1 or newer); without them it says that.
# Prints one line: the pages built and the seconds taken.
set -euo pipefail
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/../.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$PYTHON" -c "import mkdocs, mkdocstrings_handlers.python, mkdocs_jupyter, torch" 2>"$log"; then
    echo "build_docs: $PYTHON lacks the docs dependency group or torch ($(tail -n 1 "$log")); install them:" >&2
    echo "    $PYTHON -m pip install -e '.[torch]' --group docs" >&2
    # A pip older than 25.1 does not know --group: its own error would only say "no such option".
    pip_version=$("$PYTHON" -m pip --version 2>/dev/null | awk '{print $2}')
    if [[ -z $pip_version ]] || ! "$PYTHON" -c "import sys; v = tuple(map(int, sys.argv[1].split('.')[:2])); sys.exit(v < (25, 1))" "$pip_version" 2>/dev/null; then
        echo "  --group needs pip 25.1 or newer (this one: ${pip_version:-no pip}); first: $PYTHON -m pip install --upgrade pip" >&2
    fi
    exit 1
fi
start=$(date +%s.%N)
# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its future, printed on every build.
if ! NO_MKDOCS_2_WARNING=1 "$PYTHON" -m mkdocs build --strict --clean --site-dir build/site >"$log" 2>&1; then
    cat "$log" >&2
    echo "build_docs: the site did not build (strict mode: each WARNING above is an error)" >&2
    exit 1
fi
pages=$(find build/site -name index.html | wc -l)
awk -v pages="$pages" -v start="$start" -v end="$(date +%s.%N)" \
    'BEGIN { printf "build_docs: %d pages in build/site, %.1f s\n", pages, end - start }'
