#!/usr/bin/env bash
# The tests: CPU by default (Pallas kernels in interpret mode). Extra arguments
# go to pytest, e.g. `bash scripts/test.sh -k pack`.
# RLK_TEST_WORKERS: pytest-xdist worker processes (default 2, CI's cores; the
# tests are bound by XLA's single-threaded compiles, so two workers take about
# half the time of one; 0 runs them in this process).
source "$(dirname "$0")/setup_env.sh"
set +e
python -m pytest -q -n "${RLK_TEST_WORKERS:-2}" --dist worksteal "$@"
rc=$?
# pytest's 5 means "no test ran": never a pass.
exit $rc
