"""benchmarks.tunix_client for the tests: a missing Tunix (or flax,
jaxtyping, sentencepiece) skips the test that needs it, saying which."""

import pytest

from benchmarks import tunix_client as _client

IntTokenizer = _client.IntTokenizer


def model_module(family: str = "llama3"):
  try:
    return _client.model_module(family)
  except ImportError as e:
    pytest.skip(str(e))


def sampler_module():
  try:
    return _client.sampler_module()
  except ImportError as e:
    pytest.skip(str(e))
