"""Tunix's model modules as clients of rlk's tests and benchmarks, built
from configs in code with random weights (nothing downloaded).

`import tunix` runs its package ``__init__``, which imports its trainers
and their dependencies (metrax, tensorflow_datasets, ...). A model module
needs only flax, jaxtyping and three small modules of the package, so the
packages above it are entered here without their ``__init__``: the model
code that runs is Tunix's own, unchanged."""

import importlib
import importlib.util
import sys
import types


def _need(name: str, why: str = "") -> None:
  if name not in sys.modules and importlib.util.find_spec(name) is None:
    raise ImportError(f"{name} is not installed{why} (the test extra "
                      f"installs it; scripts/setup_env.sh)")


def model_module(family: str = "llama3"):
  """``tunix.models.<family>.model``; ImportError where Tunix, flax or
  jaxtyping is not installed."""
  _need("flax")
  _need("jaxtyping")
  _need("tunix", ": google-tunix")
  if "tunix" in sys.modules:
    root = list(sys.modules["tunix"].__path__)[0]
  else:
    root = importlib.util.find_spec("tunix").submodule_search_locations[0]
  for name in ("tunix", "tunix.models", f"tunix.models.{family}",
               "tunix.generate", "tunix.utils", "tunix.oss"):
    if name not in sys.modules:
      package = types.ModuleType(name)
      package.__path__ = [root + name.removeprefix("tunix").replace(".", "/")]
      sys.modules[name] = package
  return importlib.import_module(f"tunix.models.{family}.model")


def params_module(family: str = "llama3"):
  """``tunix.models.<family>.params``: Tunix's loader of a safetensors
  checkpoint (transformers' names) into its model (needs safetensors)."""
  model_module(family)
  _need("safetensors")
  return importlib.import_module(f"tunix.models.{family}.params")


def sampler_module():
  """``tunix.generate.sampler`` (its tokenizer adapter imports
  sentencepiece)."""
  model_module()
  _need("sentencepiece")
  return importlib.import_module("tunix.generate.sampler")


class IntTokenizer:
  """A tokenizer by Tunix's protocol (encode, decode, bos_id, eos_id,
  pad_id) whose text is token ids written out: "5 17 3" is [5, 17, 3].
  No BOS (id 0 means none to Tunix), pad 0, and an EOS past the vocabulary
  (never sampled), so every rollout runs its full length."""

  def __init__(self, vocab: int):
    self.vocab = vocab

  def encode(self, text: str) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self) -> int:
    return 0

  def eos_id(self) -> int:
    return self.vocab

  def pad_id(self) -> int:
    return 0
