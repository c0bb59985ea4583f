"""rlk benchmarks: one ``bench_<op>.py`` per op, run together by
``python -m benchmarks`` (the main job)."""
