# The device call of this record (H100 80GB HBM3, tree of 6822216; jax
# 0.11.2 on the image). .probe/hdr.sh as in ../on_policy_torch_llama_1b-29b3ded/
# (wheels from .whl into /tmp/site: now also flax 0.12.8, google-tunix
# 0.1.7, jaxtyping, wadler_lindig, msgpack, optax, chex, rich,
# markdown-it-py, mdurl, sentencepiece, treescope, PyYAML, etils, toolz: 5.3
# MB, --no-deps), then ../batch_invariant_tunix_gpu-997207a/device_sitecustomize.py copied to
# /tmp/site/sitecustomize.py: flax 0.12.8, the newest on PyPI, defines
# classes at import on jax.experimental.hijax names that jax 0.11.2 renamed
# or dropped (HiPrimitive, MutableHiType, AvalQDD); it aliases them so flax
# imports (nnx's opt-in hijax mode, which would use them, stays off).
timeout -s KILL 200 python3 -m cuda_ffi.build --objects /tmp/objs/obj --jobs 16
python3 -m benchmarks --only models_jax --out $OUT/bench_jax
python3 -m pytest -v -x -m "gpu or not gpu" -p no:cacheprovider tests/test_batch_invariant_tunix.py
