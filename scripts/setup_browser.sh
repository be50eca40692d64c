#!/usr/bin/env bash
# What tests/test_browser.py needs, installed from package registries only:
#   * Debian's Chromium (apt) -- Playwright drives /usr/bin/chromium and never
#     downloads a browser of its own (no `playwright install`);
#   * Python Playwright and JupyterLab in the venv.
# Idempotent; run as root (or with apt rights). VENV defaults to .venv.
set -euo pipefail

VENV="${VENV:-.venv}"
export DEBIAN_FRONTEND=noninteractive
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1

if [ ! -x /usr/bin/chromium ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi
/usr/bin/chromium --version

"$VENV/bin/python" -m pip install --quiet "playwright>=1.45" "jupyterlab>=4" "ipykernel>=6" \
    "ipywidgets>=8" "anywidget>=0.11"
"$VENV/bin/python" -c "import playwright, jupyterlab; print('playwright', playwright.__version__ if hasattr(playwright, '__version__') else 'ok', '| jupyterlab', jupyterlab.__version__)"
