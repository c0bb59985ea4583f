#!/usr/bin/env bash
# The main job: every benchmark against its peers. With no GPU it runs the
# smoke sizes; writes benchmarks/results/<device>-<date>/{results.csv,report.md}.
source "$(dirname "$0")/setup_env.sh"
python -m benchmarks "$@"
