#!/usr/bin/env bash
# The tests: CPU by default (Pallas kernels in interpret mode). Extra arguments
# go to pytest, e.g. `bash scripts/test.sh -k pack`.
source "$(dirname "$0")/setup_env.sh"
set +e
python -m pytest -q "$@"
rc=$?
# pytest's 5 means "no test ran": never a pass.
exit $rc
