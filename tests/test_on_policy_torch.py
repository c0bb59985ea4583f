"""True on-policy in torch: under ``batch_invariant_mode`` a transformers
model's rollout log-probs (``generate``, KV cache, ragged left-padded
prompts) equal its trainer's recomputation bit for bit, padded either side
or packed, eager or compiled, and a sequence rolled out alone gets the bits
it gets in the batch.

CPU: tiny configs of every family the installed transformers ships. The
device: the same at a real layer width, with more tokens."""

from __future__ import annotations

import contextlib

import pytest
import torch

import rlk_torch_bridge as rtb
from tests import on_policy_checks as opc

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
WIDTH = "real" if ON_GPU else "tiny"
# Ragged prompts whose sum is no power of two; on the device long enough to
# pass several key blocks and 512-key chunks.
LENGTHS = (37, 300, 700, 129) if ON_GPU else (5, 11, 8)
NEW = 24 if ON_GPU else 6
FAMILIES = sorted(opc.families())


def _rollout(model, sample_seed=None):
  vocab = model.config.vocab_size
  return opc.rollout(model, opc.prompts(LENGTHS, vocab, DEVICE), NEW,
                     sample_seed)


def _assert_bits(got, want, what):
  assert got.shape == want.shape, what
  diff = (got - want).abs()
  assert torch.isfinite(got).all(), f"{what}: non-finite log-probs"
  assert torch.equal(got, want), (
      f"{what}: {int((diff > 0).sum())} of {got.numel()} log-probs differ "
      f"(max {float(diff.max()):.3g})")


def test_families_cover_the_issue_list():
  # transformers 5.17 ships all eight; a smaller set means the installed
  # transformers lacks one, which this says instead of skipping quietly.
  assert set(FAMILIES) == {"llama", "qwen2", "qwen3", "mistral", "gemma2",
                           "gemma3", "phi3", "qwen3_moe"}


def test_moe_experts_run_on_det_grouped_mm(monkeypatch):
  # transformers 5 runs its experts on torch._grouped_mm; under the mode
  # each expert's rows are one det_gemm product (rlk::det_grouped_mm), in
  # the trainer's forward and in generate's aten route alike. On a GPU
  # generate would decode on "batched_mm" (a one-column bmm per token of
  # gathered weights, 5.5x slower under the mode); the mode keeps the
  # grouped product. Here transformers' GPU switch is made unconditional,
  # so the CPU run meets it too.
  from transformers.generation import utils
  from rlk_torch_bridge import batch_invariant

  @contextlib.contextmanager
  def switch_as_on_a_gpu(self):
    kept = self.get_experts_implementation()
    self.set_experts_implementation(
        {k: "batched_mm" if v == "grouped_mm" else v for k, v in kept.items()})
    try:
      yield
    finally:
      self.set_experts_implementation(kept)

  monkeypatch.setattr(utils.GenerationMixin, "_optimize_model_for_decode",
                      switch_as_on_a_gpu)
  calls = []
  original = batch_invariant.det_grouped_mm
  monkeypatch.setattr(batch_invariant, "det_grouped_mm",
                      lambda *a: calls.append(a[0].shape) or original(*a))
  model = opc.build("qwen3_moe", WIDTH, device=DEVICE)
  assert model.config._experts_implementation == "grouped_mm"
  with rtb.batch_invariant_mode():
    r = _rollout(model)
    decoding = len(calls)
    _assert_bits(opc.trainer_logp(model, r, "right"), r.logp,
                 "qwen3_moe trainer vs rollout")
  products = 2 * model.config.num_hidden_layers  # gate_up and down
  assert decoding >= NEW * products, (decoding, len(calls))
  assert len(calls) > decoding, (decoding, len(calls))
  assert "_optimize_model_for_decode" not in vars(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rollout_equals_trainer(family):
  model = opc.build(family, WIDTH, device=DEVICE)
  with rtb.batch_invariant_mode():
    r = _rollout(model)
    for layout in ("left", "right", "packed"):
      _assert_bits(opc.trainer_logp(model, r, layout), r.logp,
                   f"{family} trainer ({layout}) vs rollout")
  left = [f for f in rtb.batch_invariant.fallthroughs()
          if f[0].startswith("transformers attention")]
  assert not left, left


@pytest.mark.parametrize("family", ["llama", "gemma2"] if not ON_GPU
                         else FAMILIES)
def test_sampled_rollout_and_alone(family):
  model = opc.build(family, WIDTH, device=DEVICE)
  with rtb.batch_invariant_mode():
    r = _rollout(model, sample_seed=7)
    _assert_bits(opc.trainer_logp(model, r, "right"), r.logp,
                 f"{family} sampled rollout vs trainer")
    # The second sequence alone: same prompt, its own greedy completion.
    greedy = _rollout(model)
    alone = opc.rollout(model, greedy.prompts[1:2], NEW)
  assert torch.equal(alone.completions[0], greedy.completions[1])
  _assert_bits(alone.logp[0], greedy.logp[1], f"{family} alone vs batch")


@pytest.mark.parametrize("attn", ["eager"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_eager_attention_implementation(family, attn):
  # transformers' "eager" attention (explicit matmul + softmax, and Gemma 2's
  # logit softcap) is redirected to det_attention as well.
  model = opc.build(family, WIDTH, attn=attn, device=DEVICE)
  with rtb.batch_invariant_mode():
    r = _rollout(model)
    _assert_bits(opc.trainer_logp(model, r, "left"), r.logp,
                 f"{family} ({attn}) trainer vs rollout")


# On the device every family compiles (default), and llama also whole-graph
# and with dynamic shapes; on CPU llama alone (each compile costs ~40 s there).
@pytest.mark.parametrize("family,compile_kwargs", [
    *((f, {}) for f in FAMILIES), ("llama", {"fullgraph": True}),
    ("llama", {"dynamic": True})] if ON_GPU else [("llama", {})])
def test_compiled_trainer_equals_eager_rollout(family, compile_kwargs):
  torch._dynamo.reset()
  model = opc.build(family, WIDTH, device=DEVICE)
  compiled = torch.compile(model, **compile_kwargs)
  with rtb.batch_invariant_mode():
    r = _rollout(model)
    for layout in ("left", "right"):
      _assert_bits(opc.trainer_logp(compiled, r, layout), r.logp,
                   f"{family} compiled {compile_kwargs} ({layout})")


def _assert_sequences_alone_and_decoding(q, k, v, starts, full):
  """Each left-padded sequence of an SDPA batch (`full`) alone, and its last
  row decoded against its keys, give the batch's bits (inside the mode)."""
  sdpa = torch.nn.functional.scaled_dot_product_attention
  for i in range(q.shape[0]):
    st = int(starts[i])
    alone = sdpa(q[i:i + 1, :, st:], k[i:i + 1, :, st:], v[i:i + 1, :, st:],
                 is_causal=True)
    _assert_bits(full[i, :, st:], alone[0], f"sequence {i} padded vs alone")
    decode = sdpa(q[i:i + 1, :, -1:], k[i:i + 1, :, st:], v[i:i + 1, :, st:])
    _assert_bits(decode[0, :, 0], alone[0, :, -1], f"sequence {i} decode")


def test_plain_sdpa_call_under_the_mode():
  # F.scaled_dot_product_attention called directly: causal, padding masks
  # (bool and additive), a decode row; each sequence's rows are its own.
  g = torch.Generator().manual_seed(3)
  b, h, s, d = 3, 4, 20, 64
  q, k, v = (torch.randn(b, h, s, d, generator=g).to(DEVICE, torch.bfloat16)
             for _ in range(3))
  starts = torch.tensor([0, 7, 3], device=DEVICE)
  cols = torch.arange(s, device=DEVICE)
  tokens = cols[None] >= starts[:, None]
  causal = cols[None, :] <= cols[:, None]
  mask = (causal[None] & tokens[:, None, :])[:, None]
  additive = torch.zeros(mask.shape, dtype=torch.bfloat16, device=DEVICE)
  additive.masked_fill_(~mask, torch.finfo(torch.bfloat16).min)
  sdpa = torch.nn.functional.scaled_dot_product_attention
  with rtb.batch_invariant_mode():
    full = sdpa(q, k, v, attn_mask=mask)
    same = sdpa(q, k, v, attn_mask=additive)
    _assert_sequences_alone_and_decoding(q, k, v, starts, full)
  _assert_bits(same, full, "additive vs bool mask")
  # Under inference_mode (a rollout engine's) the mask is an inference
  # tensor, which has no version to remember it by: the same bits.
  with torch.inference_mode(), rtb.batch_invariant_mode():
    inferred = sdpa(q, k, v, attn_mask=mask.clone())
  _assert_bits(inferred, full, "inference_mode vs no_grad")
  ref = torch.nn.functional.scaled_dot_product_attention(
      q.double(), k.double(), v.double(), attn_mask=mask)
  rows = tokens[:, None, :, None].expand_as(ref)
  err = (full.double() - ref)[rows].norm() / ref[rows].norm()
  assert err < 1e-2, err


def test_a_mask_it_cannot_express_goes_to_torch():
  g = torch.Generator().manual_seed(4)
  q, k, v = (torch.randn(2, 2, 8, 64, generator=g).to(DEVICE, torch.bfloat16)
             for _ in range(3))
  bidirectional = torch.ones(2, 1, 8, 8, dtype=torch.bool, device=DEVICE)
  bidirectional[0, ..., 6:] = False
  sdpa = torch.nn.functional.scaled_dot_product_attention
  with pytest.warns(rtb.batch_invariant.BatchInvariantFallthrough,
                    match="scaled_dot_product_attention"):
    with rtb.batch_invariant_mode():
      got = sdpa(q, k, v, attn_mask=bidirectional)
  torch.testing.assert_close(got, sdpa(q, k, v, attn_mask=bidirectional))


def test_rms_norm_mean_is_the_row_kernel():
  # The mode's mean(-1) (every RMSNorm) is rlk::det_row_mean: each row's
  # bits alone as in any batch, K ragged and a power of two.
  g = torch.Generator().manual_seed(5)
  for k in (1, 100, 1024, 4096 + 17):
    x = torch.randn(37, k, generator=g).to(DEVICE) * 3
    with rtb.batch_invariant_mode():
      rows = x.pow(2).mean(-1, keepdim=True)
      alone = [x[i:i + 1].pow(2).mean(-1, keepdim=True) for i in (0, 17, 36)]
    for i, a in zip((0, 17, 36), alone):
      assert torch.equal(rows[i:i + 1], a)
    ref = x.double().pow(2).mean(-1, keepdim=True)
    assert float((rows.double() - ref).norm() / ref.norm()) < 1e-6


def test_generate_decodes_on_the_aten_route_with_the_modes_bits(monkeypatch):
  # generate under the mode decodes with the torch-function mode off the
  # stack and its replacements as aten kernels (no per-call Python for the
  # ops it leaves alone); the bits are the torch-function mode's.
  from rlk_torch_bridge import _aten_route, transformers_generate
  model = opc.build("llama", WIDTH, device=DEVICE)
  modes_on_stack = []
  enter = _aten_route.AtenRoute.__enter__

  def spy(self):
    modes_on_stack.append(torch._C._len_torch_function_stack())
    return enter(self)

  monkeypatch.setattr(_aten_route.AtenRoute, "__enter__", spy)
  with rtb.batch_invariant_mode():
    on_route = _rollout(model)
    # A forward that will be compiled keeps the torch-function mode.
    assert transformers_generate._compiled(
        model, {"cache_implementation": "static"})
    monkeypatch.setattr(transformers_generate, "_compiled", lambda *_: True)
    on_mode = _rollout(model)
  assert modes_on_stack == [0]
  assert torch.equal(on_route.completions, on_mode.completions)
  _assert_bits(on_route.logp, on_mode.logp, "aten route vs torch-function mode")


def test_aten_route_replaces_products_even_in_inference_mode(monkeypatch):
  from rlk_torch_bridge import batch_invariant
  calls = []
  det_gemm = batch_invariant.det_gemm
  monkeypatch.setattr(batch_invariant, "det_gemm",
                      lambda a, *args, **kw: calls.append(a.shape) or
                      det_gemm(a, *args, **kw))
  g = torch.Generator().manual_seed(6)
  x = torch.randn(5, 3, 64, generator=g).to(DEVICE, torch.bfloat16)
  w = torch.randn(48, 64, generator=g).to(DEVICE, torch.bfloat16)
  mode = batch_invariant.BatchInvariantMode()
  with mode:
    want = torch.nn.functional.linear(x, w)
  with mode.aten_route():
    with torch.inference_mode():
      got = torch.nn.functional.linear(x, w)
    wide = x[0].double()
    left = wide @ wide.T  # float64: not the mode's, so torch's own
  assert len(calls) == 2 and torch.equal(got, want)
  assert torch.equal(left, x[0].double() @ x[0].double().T)
  with mode.aten_route():  # the route leaves nothing behind on exit
    pass
  calls.clear()
  torch.nn.functional.linear(x, w)
  assert not calls


def test_rms_norm_scale_gradient_is_the_row_kernel():
  # x * rsqrt(var) under the mode: torch's product, and the scale's
  # gradient summed per row by rlk::det_row_sum (a row alone as in any
  # batch), K ragged and a power of two; against float64.
  g = torch.Generator().manual_seed(8)
  for k in (100, 4096):
    x = (torch.randn(37, k, generator=g) * 2).to(DEVICE).requires_grad_()
    up = torch.randn(37, k, generator=g).to(DEVICE)
    with rtb.batch_invariant_mode():
      def grads(rows):
        xr = x[rows].detach().requires_grad_()
        var = xr.pow(2).mean(-1, keepdim=True)
        out = xr * torch.rsqrt(var + 1e-6)
        assert out.grad_fn.name().endswith("RowScaledBackward")
        (out * up[rows]).sum().backward()
        return xr.grad
      batch = grads(slice(None))
      alone = [grads(slice(i, i + 1)) for i in (0, 17, 36)]
    for i, a in zip((0, 17, 36), alone):
      assert torch.equal(batch[i:i + 1], a)
    x64 = x.detach().double().requires_grad_()
    out = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    (out * up.double()).sum().backward()
    err = (batch.double() - x64.grad).norm() / x64.grad.norm()
    assert float(err) < 1e-5, float(err)


def test_training_gradients_per_sequence_and_deterministic():
  # The issue's item 4 on a real model: each sequence's gradient with
  # respect to its input embeddings is bitwise the same alone as in the
  # batch, and the weights' gradients are the same bits run to run.
  model = opc.build("llama", WIDTH, device=DEVICE)
  vocab = model.config.vocab_size
  g = torch.Generator().manual_seed(9)
  ids = torch.randint(1, vocab, (3, 24 if not ON_GPU else 300),
                      generator=g).to(DEVICE)

  def step(rows):
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids[rows]).detach().requires_grad_()
    logits = model(inputs_embeds=emb).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(
        -1, ids[rows][:, 1:, None])
    (-logp.sum()).backward()
    return emb.grad, [p.grad.clone() for p in model.parameters()
                      if p.grad is not None]

  with rtb.batch_invariant_mode():
    batch, weights = step(slice(None))
    alone = step(slice(1, 2))[0]
    _, again = step(slice(None))
  assert torch.equal(batch[1:2], alone)
  assert len(weights) == len(again) > 10
  assert all(torch.equal(a, b) for a, b in zip(weights, again))


def _tiny(config_name, model_name, attn="sdpa", **kwargs):
  import transformers
  config = getattr(transformers, config_name)(
      vocab_size=opc.VOCAB, hidden_size=128, intermediate_size=256,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=64, max_position_embeddings=512, **kwargs)
  config._attn_implementation = attn
  torch.manual_seed(0)
  return getattr(transformers, model_name)(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("family", ["gpt_oss sinks", "llama4 chunked"])
def test_attention_it_cannot_compute_goes_to_the_model(family):
  # gpt-oss's attention sinks (s_aux) and Llama 4's chunked attention are
  # not det_attention's arithmetic: the mode hands those layers to the
  # model's own function and says so. (Before: sinks silently dropped, and
  # chunked layers' rows NaN.)
  if family == "gpt_oss sinks":
    model = _tiny("GptOssConfig", "GptOssForCausalLM", "eager",
                  num_local_experts=4,
                  num_experts_per_tok=2, sliding_window=6)
    for layer in model.model.layers:  # sinks that matter
      layer.self_attn.sinks.data.fill_(3.0)
    want = "attention sinks"
  else:
    model = _tiny("Llama4TextConfig", "Llama4ForCausalLM",
                  num_local_experts=4, num_experts_per_tok=1,
                  intermediate_size_mlp=256, attention_chunk_size=6,
                  layer_types=["chunked_attention", "full_attention"],
                  moe_layers=[1])
    want = "chunked attention"
  g = torch.Generator().manual_seed(5)
  ids = torch.randint(1, opc.VOCAB, (2, 13), generator=g)
  mask = torch.ones_like(ids)
  mask[1, :4] = 0
  with torch.no_grad():
    plain = model(ids, attention_mask=mask).logits.float()
    with pytest.warns(rtb.BatchInvariantFallthrough, match=want):
      with rtb.batch_invariant_mode():
        mine = model(ids, attention_mask=mask).logits.float()
  rows = mask.bool()
  assert torch.isfinite(mine[rows]).all()
  err = (mine - plain)[rows].norm() / plain[rows].norm()
  assert err < 2e-2, err


@pytest.mark.parametrize("dims", [(80, 80), (96, 64)])
def test_head_dims_it_pads(dims):
  # Phi-2's 80 and an MLA-like 96 for q and k with 64 for v run on
  # det_attention padded with zeros: a sequence's rows alone equal its
  # rows in the padded batch, a decode row equals the prefill's, and the
  # values are attention's (float64 reference).
  d, d_v = dims
  g = torch.Generator().manual_seed(6)
  b, h, s = 3, 2, 19
  q, k = (torch.randn(b, h, s, d, generator=g).to(DEVICE, torch.bfloat16)
          for _ in range(2))
  v = torch.randn(b, h, s, d_v, generator=g).to(DEVICE, torch.bfloat16)
  starts = torch.tensor([0, 6, 2], device=DEVICE)
  cols = torch.arange(s, device=DEVICE)
  mask = ((cols[None, :] <= cols[:, None])[None]
          & (cols[None] >= starts[:, None])[:, None, :])[:, None]
  sdpa = torch.nn.functional.scaled_dot_product_attention
  with rtb.batch_invariant_mode():
    full = sdpa(q, k, v, attn_mask=mask)
    _assert_sequences_alone_and_decoding(q, k, v, starts, full)
  assert not [f for f in rtb.fallthroughs() if "head dim" in f[1]]
  ref = sdpa(q.double(), k.double(), v.double(), attn_mask=mask)
  rows = (cols[None] >= starts[:, None])[:, None, :, None].expand_as(ref)
  err = (full.double() - ref)[rows].norm() / ref[rows].norm()
  assert full.shape == ref.shape and err < 1e-2, err


def test_a_model_of_head_dim_80_is_on_policy():
  # Phi-2 / StableLM-3B's head dim, in a transformers Llama built so.
  import transformers
  config = transformers.LlamaConfig(
      vocab_size=opc.VOCAB, hidden_size=160, intermediate_size=256,
      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
      head_dim=80, max_position_embeddings=512)
  config._attn_implementation = "sdpa"
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).to(DEVICE, torch.bfloat16)
  model = model.eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  with rtb.batch_invariant_mode():
    r = _rollout(model)
    for layout in ("left", "packed"):
      _assert_bits(opc.trainer_logp(model, r, layout), r.logp,
                   f"head dim 80 trainer ({layout}) vs rollout")
  assert not [f for f in rtb.fallthroughs() if "head dim" in f[1]]


def test_one_key_head_broadcasts_over_the_query_heads():
  # Falcon's multi-query attention calls SDPA with k, v [B, 1, S, D] and no
  # enable_gqa (SDPA broadcasts the one head): det_attention takes it.
  g = torch.Generator().manual_seed(8)
  q = torch.randn(3, 4, 11, 64, generator=g).to(DEVICE, torch.bfloat16)
  k, v = (torch.randn(3, 1, 11, 64, generator=g).to(DEVICE, torch.bfloat16)
          for _ in range(2))
  sdpa = torch.nn.functional.scaled_dot_product_attention
  with rtb.batch_invariant_mode():
    out = sdpa(q, k, v, is_causal=True)
    alone = sdpa(q[2:], k[2:], v[2:], is_causal=True)
  _assert_bits(out[2:], alone, "a row alone vs in the batch")
  assert not [f for f in rtb.fallthroughs() if "enable_gqa" in f[1]]
  ref = sdpa(q.double(), k.double(), v.double(), is_causal=True)
  assert (out.double() - ref).norm() / ref.norm() < 1e-2


def test_experts_stay_grouped_through_a_generate_inside_generate():
  # transformers' early-exit assistant calls generate on the same model
  # inside its generate: the inner call's exit must leave the outer's
  # setting, and the last exit the model as it was.
  from rlk_torch_bridge import transformers_generate
  model = opc.build("qwen3_moe", "tiny")
  kept = transformers_generate._experts_kept
  with kept(model):
    with kept(model):
      assert model._optimize_model_for_decode is contextlib.nullcontext
    assert model._optimize_model_for_decode is contextlib.nullcontext
  assert "_optimize_model_for_decode" not in vars(model)
