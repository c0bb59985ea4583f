"""A real transformers model under rlk's ``batch_invariant_mode`` against
plain torch and Thinking Machines' ``batch_invariant_ops``, side by side:
training step (forward, backward, AdamW), scoring forward, ``generate``
time per token, eager and compiled, and invariance counts (a sequence's
logits in a batch of 8 against alone).

    python -m benchmarks.bench_models_torch [--smoke]

The model is ``LlamaForCausalLM`` built from a config (random weights,
nothing downloaded), bf16, SDPA: the on-policy issue's 8 layers, hidden
2048, 16 q / 4 kv heads, vocab 32000, or with
``--models_torch_model=llama-3.2-1b`` Llama-3.2-1B's shapes (16 layers,
32 q / 8 kv heads of 64, MLP 8192, vocab 128256, tied embeddings). Competitors (stable names): ``torch``,
``rlk_mode``, ``tml`` (only where ``batch_invariant_ops`` imports: carry
its source on ``PYTHONPATH``). Each timed call enters its mode itself.
"""

from __future__ import annotations

import contextlib

from absl import app, flags

from benchmarks import harness
from benchmarks.harness import Row

BENCH = "models_torch"

# The 8-layer Llama, or a real-size one (Llama-3.2-1B's shapes).
MODELS = {
    "llama-8l": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, tie_word_embeddings=True),
}
MODEL = flags.DEFINE_enum("models_torch_model", "llama-8l", list(MODELS),
                          "Which LlamaForCausalLM config to build.")
COMPILED = flags.DEFINE_bool("models_torch_compiled", True,
                             "Also time and check the compiled model.")
CASES = ("invariance", "forward", "generate", "train", "train_compiled")
CASES_FLAG = flags.DEFINE_list(
    "models_torch_cases", list(CASES),
    f"Which cases to run (of {', '.join(CASES)}): a real-size model's whole "
    "set can outlast one device call, so it can be run in parts.")


def _config(smoke: bool) -> dict:
  if smoke:
    return dict(model=dict(vocab_size=256, hidden_size=128,
                           intermediate_size=256, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1,
                           head_dim=64),
                train=(2, 32), forward=(2, 32), generate=(2, 8, 3),
                invariance=32, iters=1, compiled=False)
  return dict(model=MODELS[MODEL.value],
              train=(8, 1024), forward=(32, 512), generate=(8, 128, 32),
              invariance=256, iters=3, compiled=COMPILED.value)


def _modes(torch) -> dict:
  import rlk_torch_bridge as rtb
  modes = {"torch": contextlib.nullcontext, "rlk_mode": rtb.batch_invariant_mode}
  try:
    import batch_invariant_ops as tml
    modes["tml"] = lambda: tml.set_batch_invariant_mode(True)
  except ImportError:
    pass
  return modes


def _model(torch, cfg, dev):
  import transformers
  config = transformers.LlamaConfig(**cfg["model"])
  config._attn_implementation = "sdpa"
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).to(dev, torch.bfloat16)
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model


def _ids(torch, cfg, b, s, dev, seed):
  g = torch.Generator(device=dev).manual_seed(seed)
  return torch.randint(1, cfg["model"]["vocab_size"], (b, s), device=dev,
                       generator=g)


def _train_rows(torch, cfg, model, modes, dev, compiled) -> list[Row]:
  b, s = cfg["train"]
  ids = _ids(torch, cfg, b, s, dev, 1)
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
  run = torch.compile(model, dynamic=False) if compiled else model
  tag = "compiled" if compiled else "eager"

  def make(mode):
    def step():
      with mode():
        loss = run(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return harness.torch_batch(step, [()])
  comps = {name: (lambda m=m: make(m)) for name, m in modes.items()
           if not (compiled and name == "tml")}
  flops = 6.0 * b * s * sum(p.numel() for p in model.parameters())
  model.train()
  rows = harness.interleaved_rows(BENCH, f"train step {b}x{s} {tag}", comps,
                                  flops=flops, iters=cfg["iters"])
  model.eval()
  return rows


def _forward_rows(torch, cfg, model, modes, dev) -> list[Row]:
  b, s = cfg["forward"]
  ids = _ids(torch, cfg, b, s, dev, 2)

  def make(mode):
    def fwd():
      with mode(), torch.no_grad():
        model(ids)
    return harness.torch_batch(fwd, [()])
  comps = {name: (lambda m=m: make(m)) for name, m in modes.items()}
  return harness.interleaved_rows(BENCH, f"forward {b}x{s} eager", comps,
                                  iters=cfg["iters"])


def _generate_rows(torch, cfg, model, modes, dev) -> list[Row]:
  b, s, new = cfg["generate"]
  ids = _ids(torch, cfg, b, s, dev, 3)
  mask = torch.ones_like(ids)
  for i in range(b):  # ragged prompts, left padding
    mask[i, :(i * 7) % (s // 2)] = 0

  def make(mode):
    def gen():
      with mode(), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False)
    return harness.torch_batch(gen, [()])
  comps = {name: (lambda m=m: make(m)) for name, m in modes.items()}
  rows = harness.interleaved_rows(BENCH, f"generate B={b} prompt {s} new "
                                  f"{new}", comps, iters=max(1, cfg["iters"] // 2))
  for r in rows:
    if r.median_ms:
      r.note = f"{r.median_ms / new:.2f} ms per token"
  return rows


def _invariance_rows(torch, cfg, model, modes, dev) -> list[Row]:
  s = cfg["invariance"]
  ids = _ids(torch, cfg, 8, s, dev, 4)
  rows = []
  runs = {"eager": model}
  if cfg["compiled"]:
    # dynamic=False: batch 8 then 1 would otherwise recompile with dynamic
    # shapes, which the mode does not survive yet (README, limitations).
    runs["compiled"] = torch.compile(model, dynamic=False)
  for tag, run in runs.items():
    for name, mode in modes.items():
      try:
        with mode(), torch.no_grad():
          batch = run(ids).logits[3]
          alone = run(ids[3:4]).logits[0]
        differ = int((batch != alone).any(-1).sum())
        note = f"batch 8 vs alone: {differ} of {s} positions differ"
      except Exception as e:  # noqa: BLE001 - reported in the table
        note = f"FAILED: {type(e).__name__}: {str(e)[:100]}"
      rows.append(harness.progress(Row(BENCH, f"invariance {tag} S={s}", name,
                                       note=note)))
  return rows


def run(smoke: bool) -> list[Row]:
  torch = harness.torch_or_none()
  try:
    import transformers  # noqa: F401 - the client under test
  except ImportError as e:
    return [Row(BENCH, "all", "rlk_mode", note=f"transformers: {e}")]
  if torch is None:
    return [Row(BENCH, "all", "rlk_mode", note="torch is not installed")]
  cfg = _config(smoke)
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  unknown = sorted(set(CASES_FLAG.value) - set(CASES))
  if unknown:
    raise ValueError(f"--models_torch_cases: unknown {unknown}; the cases "
                     f"are {list(CASES)}")
  model = _model(torch, cfg, dev).eval()
  modes = _modes(torch)
  cases = {
      "invariance": lambda: _invariance_rows(torch, cfg, model, modes, dev),
      "forward": lambda: _forward_rows(torch, cfg, model, modes, dev),
      "generate": lambda: _generate_rows(torch, cfg, model, modes, dev),
      "train": lambda: _train_rows(torch, cfg, model, modes, dev,
                                   compiled=False),
      "train_compiled": lambda: (_train_rows(torch, cfg, model, modes, dev,
                                             compiled=True)
                                 if cfg["compiled"] else []),
  }
  return [row for name in CASES if name in CASES_FLAG.value
          for row in cases[name]()]


def main(argv):
  del argv
  print(harness.format_table(run(harness.smoke_mode()), peer="torch"))


if __name__ == "__main__":
  app.run(main)
