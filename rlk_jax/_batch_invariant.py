"""``rlk_jax.batch_invariant(fn)``: a transformation that makes an
unmodified JAX function batch-invariant: a row's results do not depend on
which other rows share its batch.

Why a jaxpr interpreter: the ops that break batch invariance are XLA's
products and reductions, whose summation order XLA may choose per shape
(on the H100 every row of a dot differed at m <= 256; on CPU a tiny Llama's
row differs alone and in a batch of 16). A custom lowering rule would
change every program of the process; an interpreter changes only the
function it wraps, composes like ``jax.checkpoint`` or ``jax.vmap`` do
(it runs at trace time, inside ``jit``, ``grad``, ``vmap``), and can say
what it left alone.

``batch_invariant(fn)(*args)`` traces ``fn`` to a jaxpr for these
arguments and evaluates it equation by equation:

- ``dot_general`` (any batch and contracting dimensions: einsum, matmul,
  attention's products; bf16, f16, f32 operands) runs on
  ``rlk_jax.det_gemm``: free dims of the left operand are its rows, of the
  right one its columns, batch dims a ``vmap`` (or, for small ones, one
  call over every batch pair, ``_folded_batch_product``). Every output
  element sums its own products in K order, so its bits depend on its own
  row and column only.
- ``reduce_sum`` over the last axis of a float array (what ``mean``,
  ``var`` and an RMSNorm reduce; a softmax's normaliser) runs on
  ``reference.row_sum``: the cuda_ffi row kernel's order, elementwise adds
  over each row's own values, accumulated in f32.
- ``exp``, ``expm1``, ``log``, ``log1p``, ``logistic``, ``rsqrt``,
  ``sqrt`` and ``tanh`` of f32/bf16/f16 on CPU run on ``reference``'s
  functions of the same names (adds, multiplies, divisions, square roots
  and exponent bits; derivatives by their own rules): XLA:CPU's versions fused after
  a broadcast (a softmax's ``exp(s - max)``, a log-softmax's ``s -
  log(sum)``) take one code path or another per element as the loop's
  shape decides, and the paths disagree on some inputs (Tunix's Qwen 3: a
  row's logits alone differed from its batch's, in plain ``jit`` too; its
  sampler's log-probs by one ulp). Other platforms keep XLA's (on GPUs
  libdevice's, one code path for every element).
- A float division on CPU stays a division (``_divide``): XLA's
  simplifier otherwise rewrites some into products by a reciprocal, as
  the shapes around them decide.
- Inside ``jit``, ``checkpoint``, ``scan``, ``while_loop``, ``cond``,
  ``shard_map`` and ``custom_jvp`` functions the same rules apply to their
  bodies (rebuilt through the public API with the same settings). A ``custom_jvp``
  function whose body needs rewriting is evaluated inline: its derivative
  is then the rewritten body's (its own rule is set aside, and the report
  says so); one with nothing to rewrite is left whole.
- Everything else is bound unchanged. What it cannot make invariant (an
  integer product, a sum over other axes, a ``custom_vjp`` function with
  products inside) is left alone and listed by ``report``. A
  ``shard_map`` body is rewritten like any other (its replication checks
  off).

Gradients: applied inside ``grad`` (``jax.grad(batch_invariant(f))``, the
form to train with) the backward is JAX's VJP of the rewritten forward,
traced and rewritten by the same rules (``_rewritten_both_ways``):
det_gemm's and det_attention's own backward kernels, and rlk's row sum for
the sums autodiff adds. Applied outside (``batch_invariant(jax.grad(f))``)
the backward is part of the jaxpr and every product and last-axis sum in
it is rewritten too, but attention's intermediates then feed JAX's own
backward, so it stays on its products (on the H100 a Tunix training step
ran 0.46x plain XLA's so, 1.16x inside ``grad``).

Softmax attention (``_attention_pattern``: two products with a softmax
over the keys between them, a mask, bf16/f16, head dim 64/128/256) runs on
det_attention's masked layout: each row sees its sequence's keys walked
from the sequence's first key, whatever else shares the batch, and a
decode step against a cache gives the prefill's bits.
"""

from __future__ import annotations

import collections
import copy
import functools
import math

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from rlk_jax import _attention, _attention_pattern, reference
from rlk_jax._det_gemm import GEMM_DTYPES, det_gemm

__all__ = ["batch_invariant"]


def batch_invariant(fn, *, implementation: str | None = None,
                    attention: str = "det_attention",
                    attention_segments: int = 1):
  """``fn`` with its products on det_gemm and its last-axis sums on rlk's
  row sum (module docstring). `implementation` pins det_gemm's (and
  det_attention's, where it has one of that name; pin one in both rollout
  and training).

  `attention`: ``"det_attention"`` runs each softmax attention it
  recognises (``_attention_pattern``: bf16/f16, head dim 64, 128 or 256,
  a mask) on det_attention's masked layout, whose mask must be causal
  runs cut by padding, up to `attention_segments` sequences a batch row (a
  pack); rows of a batch row whose mask is anything else (a sliding
  window, a bidirectional prefix) come back NaN. ``"products"`` leaves
  attention to the rules for its products and sums (any mask).

  The result has ``.report(*args, **kwargs)``: what this transformation
  left alone for those arguments, as ``{description: count}``, and
  ``.attentions(*args, **kwargs)``: how many attentions run on
  det_attention."""
  if attention not in ("det_attention", "products"):
    raise ValueError(f"batch_invariant: attention must be 'det_attention' or "
                     f"'products', got {attention!r}")
  rules = _Rules(implementation, attention == "det_attention",
                 int(attention_segments))

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    closed, flat, out_tree = _trace(fn, args, kwargs)
    out = _rewritten_both_ways(rules, closed)(*flat)
    return jax.tree_util.tree_unflatten(out_tree, out)

  def report(*args, **kwargs) -> dict[str, int]:
    closed, _, _ = _trace(fn, args, kwargs)
    left: collections.Counter = collections.Counter()
    _survey(closed.jaxpr, left)
    return dict(left)

  def attentions(*args, **kwargs) -> int:
    closed, _, _ = _trace(fn, args, kwargs)
    return rules.attentions(closed.jaxpr, closed.consts)

  wrapped.report = report
  wrapped.attentions = attentions
  return wrapped


def _rewritten_both_ways(rules, closed):
  """The rewritten jaxpr as a function whose reverse-mode derivative is
  rewritten too. Differentiated from outside (``jax.grad(batch_invariant(
  f))``), JAX's own transposes would otherwise run the backward: the sums
  autodiff adds (a norm's statistic broadcast over a row transposes to a
  sum over the row) on XLA's reductions. So the backward is JAX's VJP of
  the rewritten forward (det_gemm's and det_attention's own backward
  kernels inside it), traced and evaluated under the same rules.
  Forward-mode derivatives were never available (det_gemm and
  det_attention are ``custom_vjp`` functions)."""

  def run(*leaves):
    return rules.eval(closed.jaxpr, closed.consts, leaves)

  differentiable = jax.custom_vjp(run)

  def forward(*leaves):
    out, vjp = jax.vjp(run, *leaves)
    return out, (vjp, tuple(_is_float(jax.typeof(x)) for x in leaves),
                 tuple(jax.ShapeDtypeStruct(jnp.shape(o), jnp.result_type(o))
                       for o in out))

  def backward(saved, cts):
    vjp, float_in, out_types = saved
    residuals, tree = jax.tree_util.tree_flatten(vjp)
    float_out = [_is_float(t) for t in out_types]

    def transpose(residuals, float_cts):
      it = iter(float_cts)
      cts = [next(it) if f else np.zeros(t.shape, jax.dtypes.float0)
             for f, t in zip(float_out, out_types)]
      grads = jax.tree_util.tree_unflatten(tree, residuals)(cts)
      return [g for g, f in zip(grads, float_in) if f]

    float_cts = [c for c, f in zip(cts, float_out) if f]
    back = jax.make_jaxpr(transpose)(residuals, float_cts)
    grads = iter(rules.eval(back.jaxpr, back.consts,
                            [*residuals, *float_cts]))
    return tuple(next(grads) if f else None for f in float_in)

  differentiable.defvjp(forward, backward)
  return differentiable


def _trace(fn, args, kwargs):
  """`fn`'s jaxpr over the flat leaves of its arguments, the leaves, and
  its output's tree. Traced as a function of leaves to leaves: inside an
  enclosing trace (this transformation runs inside ``jit``) JAX compares a
  traced function's argument and result trees with trees it cached, and a
  tree whose static metadata holds an Array (Tunix's sampling state keeps
  its prompt length so) compares by a traced ``==`` that has no truth
  value."""
  flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
  out_tree = []

  def flat_fn(*leaves):
    a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
    out, tree = jax.tree_util.tree_flatten(fn(*a, **k))
    out_tree.append(tree)
    return out

  closed = jax.make_jaxpr(flat_fn)(*flat)
  return closed, flat, out_tree[0]


# ---------------------------------------------------------------------------
# What to rewrite

def _is_float(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.floating)


def _dot_takes(eqn) -> str | None:
  """Why det_gemm cannot take this dot_general (None: it can)."""
  lhs, rhs = (v.aval for v in eqn.invars)
  out = eqn.outvars[0].aval
  for x in (lhs, rhs, out):
    if jnp.dtype(x.dtype) not in GEMM_DTYPES:
      return f"dot_general of {lhs.dtype} x {rhs.dtype} -> {out.dtype}"
  return None


def _sum_is_row_sum(eqn) -> bool:
  x = eqn.invars[0].aval
  return _is_float(x) and tuple(eqn.params["axes"]) == (x.ndim - 1,)


def _sum_takes(eqn) -> str | None:
  """Why a float reduce_sum is left to XLA (None: it is rewritten, or it
  is exact in any order: an integer sum, or one addend a result)."""
  x = eqn.invars[0].aval
  axes = tuple(eqn.params["axes"])
  if not _is_float(x) or _sum_is_row_sum(eqn):
    return None
  if math.prod(x.shape[a] for a in axes) <= 1:
    # A size-1 axis summed away (an einsum's index that only one operand
    # has, such as Tunix's MoE dispatch 'BTID,BTEK->BTED' with I = 1).
    return None
  return f"reduce_sum over axes {axes} of a rank-{x.ndim} array"


def _scatter_takes(eqn) -> str | None:
  """Why a float scatter-add (an embedding's backward, say) is left to XLA,
  whose GPU scatter adds with atomics in whatever order they land (None: it
  is rewritten, or it is an integer one, exact in any order)."""
  operand, indices, updates = (v.aval for v in eqn.invars)
  if not _is_float(operand):
    return None
  d = eqn.params["dimension_numbers"]
  rows_of_operand = (
      d.inserted_window_dims == (0,) and d.scatter_dims_to_operand_dims == (0,)
      and not d.operand_batching_dims and not d.scatter_indices_batching_dims
      and indices.shape[-1:] == (1,)
      and d.update_window_dims == tuple(range(indices.ndim - 1, updates.ndim))
      and updates.shape[indices.ndim - 1:] == operand.shape[1:])
  if rows_of_operand:
    return None
  return (f"scatter-add into {operand.shape} other than whole rows by one "
          f"index ({d})")


def _own_kernel(eqn) -> bool:
  """Whether `eqn` calls one of rlk's own kernel functions (a jit named
  ``rlk_...``: det_attention's backward): bound whole, never rewritten. Their
  bits are the kernels' contract; rewriting their CPU reference would
  change it (an ordered scatter-add sums over every row of the call, not
  each sequence's own)."""
  return (eqn.primitive.name in _attention_pattern.CALLS
          and str(eqn.params.get("name", "")).startswith("rlk_"))


def _subjaxprs(eqn):
  """The jaxprs (open) inside a higher-order equation (none for rlk's own
  kernels, which are not looked into)."""
  if _own_kernel(eqn):
    return []
  out = []
  for value in eqn.params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(v, jex.ClosedJaxpr):
        out.append(v.jaxpr)
      elif isinstance(v, jex.Jaxpr):
        out.append(v)
  return out


def _rewritten(eqn) -> str | None:
  """Which rule rewrites this equation itself ("dot", "row_sum"), if any."""
  name = eqn.primitive.name
  if name == "dot_general" and _dot_takes(eqn) is None:
    return "dot"
  if name == "reduce_sum" and _sum_is_row_sum(eqn):
    return "row_sum"
  if (name == "scatter-add" and _is_float(eqn.invars[0].aval)
      and _scatter_takes(eqn) is None):
    return "scatter_add"
  if name in _PER_ELEMENT and eqn.invars[0].aval.dtype in _PER_ELEMENT_DTYPES:
    return "per_element"
  if name == "div" and _is_float(eqn.invars[1].aval):
    return "divide"
  return None


# The transcendental functions rewritten on CPU (module docstring), with
# their plain-arithmetic forms.
_PER_ELEMENT = {"exp": reference.exp, "expm1": reference.expm1,
                "log": reference.log, "log1p": reference.log1p,
                "logistic": reference.logistic, "rsqrt": reference.rsqrt,
                "sqrt": reference.sqrt, "tanh": reference.tanh}
_PER_ELEMENT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _by_platform(platform, *args, cpu, default):
  """``platform_dependent``, or its branch itself where the platform is
  known when tracing (a ``shard_map`` body's: its mesh's devices). Inside
  ``shard_map``, JAX 0.10 linearised platform_dependent's ``cond`` into
  branches of mismatched varying axes, and gradients failed to trace."""
  if platform is None:
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)
  return (cpu if platform == "cpu" else default)(*args)


def _per_element(eqn, x, platform=None):
  """The equation's function with an element's bits its own: reference's
  plain-arithmetic form on CPU (module docstring), the primitive as bound
  elsewhere; computed in f32 as XLA does for 2-byte floats."""
  params = eqn.params
  y = _by_platform(
      platform, x.astype(jnp.float32), cpu=_PER_ELEMENT[eqn.primitive.name],
      default=lambda y: eqn.primitive.bind(y, **params))
  return y.astype(x.dtype)


def _divide(x, y, dtype, platform=None):
  """``x / y``, a true division at every shape. XLA's algebraic simplifier
  rewrites a division by what it sees of the divisor (``a /
  broadcast(b)`` into ``a * broadcast(1 / b)``, ``a / sqrt(b)`` into ``a *
  rsqrt(b)``, ``a / pow(b, c)`` into ``a * pow(b, -c)``) where its pattern
  matches, and whether it matches follows the shapes around it: Tunix's
  Qwen 3 divided its positions by the rope's timescale alone and
  multiplied them by the timescale's inverse in a batch of 4, so a decode
  step's logits took other bits alone. On CPU the divisor, broadcast to
  the quotient's shape, goes behind a barrier: nothing of it is left to
  see. (A product by the reciprocal instead would not do: XLA:CPU then
  contracts it with a following add into a fused multiply-add in one
  fusion and not in another, as a sampler's ``logits / temperature - max``
  against the trainer's.) Other platforms divide as XLA does: a barrier
  there would cost the broadcast divisor's memory traffic."""
  x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
  shape = jnp.broadcast_shapes(x.shape, y.shape)
  return _by_platform(
      platform, x, y, default=lambda x, y: x / y,
      cpu=lambda x, y: x / jax.lax.optimization_barrier(
          jnp.broadcast_to(y, shape)))


_PRECISION = {jnp.dtype(jnp.bfloat16): (8, 7), jnp.dtype(jnp.float16): (5, 10)}


def _rounded_on_cpu(x, platform=None):
  """`x` (a rewritten product's 2-byte float result) fenced on CPU so its
  consumers read it rounded. XLA:CPU computes 2-byte floats in f32 and,
  allowed excess precision (its default), drops a ``convert`` to bf16 and
  back where its passes meet the pair, which they did for a det_gemm
  result in one batch and not in another (Tunix's Llama 3 in bf16: every
  row of a batch of 8 differed from the row alone). A ``reduce_precision``
  of the f32 value is no pair to drop. Other platforms are left as they
  are (a pass over the product's output)."""
  bits = _PRECISION.get(jnp.dtype(x.dtype))
  if bits is None:
    return x
  return _by_platform(
      platform, x, default=lambda y: y,
      cpu=lambda y: jax.lax.reduce_precision(
          y.astype(jnp.float32), *bits).astype(y.dtype))


def _needs_rewrite(jaxpr) -> bool:
  """Whether anything in `jaxpr` (or below it) is rewritten."""
  return any(_rewritten(eqn) or any(_needs_rewrite(j) for j in _subjaxprs(eqn))
             for eqn in jaxpr.eqns)


def _survey(jaxpr, left) -> None:
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    reason = None
    if name == "dot_general":
      # A product with nothing contracted (Qwen 2's rope, positions outer
      # frequencies, int x float) sums nothing: each element is one
      # multiply, the same bits in any batch.
      (contracting, _), _ = eqn.params["dimension_numbers"]
      reason = _dot_takes(eqn) if len(contracting) else None
    elif name == "reduce_sum":
      reason = _sum_takes(eqn)
    elif name == "scatter-add":
      reason = _scatter_takes(eqn)
    elif name in _LEFT_WHOLE and any(_needs_rewrite(j)
                                    for j in _subjaxprs(eqn)):
      reason = (f"{name}: its body has products or sums, left as they are "
                f"({_LEFT_WHOLE[name]})")
    elif name in _INLINED and any(_needs_rewrite(j) for j in _subjaxprs(eqn)):
      left[f"{name}: evaluated inline, its own derivative rule set aside"] += 1
    if reason:
      left[reason] += 1
    for j in _subjaxprs(eqn):
      _survey(j, left)


# Higher-order primitives bound whole, with why (their bodies are not
# rebuilt: a custom_vjp's backward is the user's).
_LEFT_WHOLE = {
    "custom_vjp_call": "its forward and backward are the function's own",
    "custom_vjp_call_jaxpr": "its forward and backward are the function's own",
}
_INLINED = ("custom_jvp_call",)


# ---------------------------------------------------------------------------
# The interpreter

class _Rules:

  def __init__(self, implementation, attention: bool = False,
               segments: int = 1):
    self.implementation = implementation
    self.attention = attention
    self.segments = segments
    self.platform = None  # known when tracing: a shard_map body's
    self.unchecked_manual = False  # in a shard_map rebuilt unchecked

  def _attention_matches(self, jaxpr, consts):
    """(jaxpr, consts, matches): with its jit calls inlined where attention
    is looked for (a mask's ``jnp.where`` is a call of its own)."""
    if not self.attention:
      return jaxpr, consts, {}
    if (any(e.primitive.name in _attention_pattern.CALLS for e in jaxpr.eqns)
        and not _varies_over_mesh_axes(jaxpr)):
      # (Inside a checked shard_map an attention whose pieces cross jit
      # calls is not seen, and stays on products: still invariant.)
      jaxpr, consts = _inlined(jaxpr, consts)
    return jaxpr, consts, _attention_pattern.find(
        jaxpr, _attention.HEAD_DIMS, ("bfloat16", "float16"))

  def attentions(self, jaxpr, consts) -> int:
    jaxpr, _, matches = self._attention_matches(jaxpr, consts)
    replaced = set().union(*(m.replaced for m in matches.values()))
    return len(matches) + sum(
        self.attentions(j, ()) for i, e in enumerate(jaxpr.eqns)
        if i not in replaced for j in _subjaxprs(e))

  def _attend(self, q, k, v, mask, scale):
    impl = self.implementation
    if impl not in _attention.TABLE.implementations:
      impl = None
    return _attention.det_attention(
        q, k, v, attn_mask=mask, scale=scale,
        segments_per_row=self.segments, implementation=impl)

  def eval(self, jaxpr, consts, args):
    env = {}

    def read(v):
      return v.val if isinstance(v, jex.Literal) else env[v]

    jaxpr, consts, matches = self._attention_matches(jaxpr, consts)
    replaced = set().union(*(m.replaced for m in matches.values()))
    for var, val in zip(jaxpr.constvars, consts):
      env[var] = val
    for var, val in zip(jaxpr.invars, args):
      env[var] = val
    for index, eqn in enumerate(jaxpr.eqns):
      if index in matches:
        m = matches[index]
        env[eqn.outvars[0]] = _rounded_on_cpu(_attention_pattern.evaluate(
            m, read(m.q), read(m.k), read(m.v),
            [read(spec.source) for spec in m.masks], eqn.outvars[0].aval,
            self._attend), self.platform)
        continue
      if index in replaced:
        continue
      invals = [read(v) for v in eqn.invars]
      if self.unchecked_manual and eqn.primitive.name == "pvary":
        # A shard_map body rebuilt without replication checks: the varying
        # type it marks is not tracked there (the values are unchanged).
        env.update(zip(eqn.outvars, invals))
        continue
      outvals = self._equation(eqn, invals)
      if not eqn.primitive.multiple_results:
        outvals = [outvals]
      for var, val in zip(eqn.outvars, outvals):
        env[var] = val
    return [read(v) for v in jaxpr.outvars]

  def _closed(self, closed, args):
    return self.eval(closed.jaxpr, closed.consts, args)

  def _equation(self, eqn, invals):
    rewrite = _rewritten(eqn)
    if rewrite == "dot":
      return _rounded_on_cpu(self._dot(eqn, *invals), self.platform)
    if rewrite == "row_sum":
      return reference.row_sum(invals[0]).astype(eqn.outvars[0].aval.dtype)
    if rewrite == "scatter_add":
      return _ordered_row_scatter_add(*invals, mode=eqn.params["mode"])
    if rewrite == "per_element":
      return _per_element(eqn, invals[0], self.platform)
    if rewrite == "divide":
      return _divide(*invals, eqn.outvars[0].aval.dtype, self.platform)
    rule = _HIGHER_ORDER.get(eqn.primitive.name)
    if rule is not None and any(_needs_rewrite(j) for j in _subjaxprs(eqn)):
      return rule(self, eqn, invals)
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # JAX before 0.7: (subfuns, params)
      subfuns, params = params
    with eqn.ctx.manager:
      return eqn.primitive.bind(*subfuns, *invals, **params)

  def _dot(self, eqn, lhs, rhs):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    # K is flattened in the right operand's dimension order (the pairs are
    # sorted by it): a weight [heads, head_dim, out] contracted over its
    # first two dimensions in the order (head_dim, heads), as einsum may
    # name them, was transposed, all 8 MB of it, on every decode step. The
    # order is the product's K order, so it must not depend on the shapes
    # (which operand is bigger changes with the batch): the right operand's
    # always.
    if len(rc) > 1:
      lc, rc = zip(*sorted(zip(lc, rc), key=lambda pair: pair[1]))
    out_dtype = eqn.outvars[0].aval.dtype
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    # [batch..., rows..., K] and [batch..., K, columns...], flattened.
    a = jnp.transpose(lhs, (*lb, *lf, *lc))
    b = jnp.transpose(rhs, (*rb, *rc, *rf))
    batch = a.shape[:len(lb)]
    rows = a.shape[len(lb):len(lb) + len(lf)]
    cols = b.shape[len(rb) + len(rc):]
    k = int(np.prod(a.shape[len(lb) + len(lf):], dtype=np.int64))
    nb = int(np.prod(batch, dtype=np.int64))
    m = int(np.prod(rows, dtype=np.int64))
    n = int(np.prod(cols, dtype=np.int64))
    a = a.reshape(nb, m, k)
    b = b.reshape(nb, k, n)
    if 0 in (nb, m, n):
      return jnp.zeros((*batch, *rows, *cols), out_dtype)
    if k == 0:  # an empty sum is +0.0
      return jnp.zeros((*batch, *rows, *cols), out_dtype)
    product = functools.partial(det_gemm, out_dtype=out_dtype,
                                implementation=self.implementation)
    if nb == 1:
      c = product(a[0], b[0])[None]
    elif nb * nb * m * n <= _FOLDED_OUTPUTS:
      c = _folded_batch_product(product, a, b)
    else:
      c = jax.vmap(product)(a, b)
    return c.reshape(*batch, *rows, *cols)

  # Higher-order primitives whose bodies have something to rewrite: rebuilt
  # through the public API with the equation's own settings.

  def _inline(self, eqn, invals):
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(closed, jex.Jaxpr):
      return self.eval(closed, (), invals)
    return self._closed(closed, invals)

  def _checkpoint(self, eqn, invals):
    body = eqn.params["jaxpr"]
    f = jax.checkpoint(lambda *a: self.eval(body, (), a),
                       prevent_cse=eqn.params["prevent_cse"],
                       policy=eqn.params.get("policy"))
    return f(*invals)

  def _scan(self, eqn, invals):
    # The scan rebound with its body rewritten and every other parameter as
    # it was: how its operands split into consts, carry and xs is the
    # primitive's own business (JAX 0.11 replaced num_consts/num_carry by
    # other parameters), and the body keeps its signature.
    params = dict(eqn.params)
    params["jaxpr"] = self._rewritten_body(params["jaxpr"])
    with eqn.ctx.manager:
      return eqn.primitive.bind(*invals, **params)

  def _rewritten_body(self, closed):
    """`closed` (a ClosedJaxpr) with its products and sums rewritten: the
    same input and output types."""
    out_avals = [v.aval for v in closed.jaxpr.outvars]

    def body(*args):
      outs = self._closed(closed, args)
      return [jax.lax.convert_element_type(o, a.dtype)
              for o, a in zip(outs, out_avals)]

    return jax.make_jaxpr(body)(*(v.aval for v in closed.jaxpr.invars))

  def _while(self, eqn, invals):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:nc], invals[nc:nc + nb]
    init = list(invals[nc + nb:])
    cond = lambda c: self._closed(p["cond_jaxpr"], [*cond_consts, *c])[0]
    body = lambda c: self._closed(p["body_jaxpr"], [*body_consts, *c])
    return jax.lax.while_loop(cond, body, init)

  def _shard_map(self, eqn, invals):
    # The body is the per-device program: its products and row sums are
    # rewritten as any other's (a row's bits are its own on every device).
    # Rebuilt through jax.shard_map with the equation's mesh, specs and
    # manual axes. Replication checks off: rlk's kernel calls (Pallas,
    # FFI) declare their results without the varying-axes types a checked
    # shard_map asks of them.
    p = eqn.params
    body = p["jaxpr"]
    inner = copy.copy(self)
    inner.unchecked_manual = True
    devices = getattr(p["mesh"], "devices", None)
    if devices is not None and devices.size:
      inner.platform = devices.flat[0].platform
    rebuilt = jax.shard_map(
        lambda *args: tuple(inner.eval(body, (), args)), mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
        axis_names=set(p["newly_manual_axes"]), check_vma=False)
    return list(rebuilt(*invals))

  def _cond(self, eqn, invals):
    index, *operands = invals
    branches = [functools.partial(
        lambda br, *ops: self._closed(br, ops), br)
                for br in eqn.params["branches"]]
    return jax.lax.switch(index, branches, *operands)


def _inlined(jaxpr, consts):
  """`jaxpr` retraced with its jit calls (and theirs) inlined: the same
  computation, one level, so a pattern that crosses a call is seen whole."""

  def run(*args):
    return _eval_inlining(jaxpr, consts, args)

  closed = jax.make_jaxpr(run)(*(
      jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                           weak_type=getattr(v.aval, "weak_type", False))
      for v in jaxpr.invars))
  return closed.jaxpr, closed.consts


def _varies_over_mesh_axes(jaxpr) -> bool:
  """Whether `jaxpr` was traced inside a checked ``shard_map`` (its inputs
  typed by the mesh axes they vary over): a retrace from plain shapes
  would drop those types and fail the checks."""
  return any(reference.varying_axes(v.aval) for v in jaxpr.invars)


def _eval_inlining(jaxpr, consts, args):
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if eqn.primitive.name in _attention_pattern.CALLS and not _own_kernel(eqn):
      body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      outs = (_eval_inlining(body, (), invals) if isinstance(body, jex.Jaxpr)
              else _eval_inlining(body.jaxpr, body.consts, invals))
    else:
      params = eqn.primitive.get_bind_params(eqn.params)
      subfuns = ()
      if isinstance(params, tuple):
        subfuns, params = params
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


# The most output elements (all batch pairs) a batched product computes
# folded into one det_gemm call: 16 Mi, 64 MiB in f32.
_FOLDED_OUTPUTS = 1 << 24


def _folded_batch_product(product, a, b):
  """``a [nb, m, k] @ b [nb, k, n]`` as one det_gemm call: every batch
  element's rows against every one's columns, ``[nb * m, k] @ [k, nb *
  n]``, and the diagonal blocks kept. det_gemm sums each output element's
  K products in one order whatever the shape around it, so each kept
  element has the bits of its own batch element's product; the wasted
  blocks cost ``nb`` times the work, which a decode step's attention (a
  few rows per batch element) spends instead of ``nb`` launches of det_gemm
  under a sequential ``vmap``."""
  nb, m, k = a.shape
  n = b.shape[2]
  c = product(a.reshape(nb * m, k),
              jnp.transpose(b, (1, 0, 2)).reshape(k, nb * n))
  c = c.reshape(nb, m, nb, n)
  diagonal = jnp.arange(nb)
  return c[diagonal, :, diagonal, :]


def _ordered_row_scatter_add(operand, indices, updates, *, mode):
  """``operand.at[indices].add(updates)`` on whole rows, with no atomics:
  the updates are stably sorted by row, each row's run is summed by a
  segmented scan (a fixed tree for a given number of updates) and read back
  by a gather. Run to run the same bits; an id outside [0, V) adds nothing
  (a scatter's FILL_OR_DROP; PROMISE_IN_BOUNDS leaves it undefined anyway),
  except under CLIP, where it adds to the nearest row as XLA's would."""
  v = operand.shape[0]
  ids = indices.reshape(-1).astype(jnp.int32)
  rows = updates.reshape(ids.shape[0], -1).astype(operand.dtype)
  if ids.shape[0] == 0:
    return operand
  if mode == jax.lax.GatherScatterMode.CLIP:
    ids = jnp.clip(ids, 0, v - 1)
  ids = jnp.where((ids >= 0) & (ids < v), ids, v)  # v: dropped
  order = jnp.argsort(ids, stable=True)
  ids, rows = ids[order], rows[order]
  starts = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])

  def combine(a, b):
    (a_start, a_sum), (b_start, b_sum) = a, b
    return a_start | b_start, jnp.where(b_start[:, None], b_sum, a_sum + b_sum)

  _, runs = jax.lax.associative_scan(combine, (starts, rows))
  # Each row's run ends at the last position with its id.
  last = jnp.searchsorted(ids, jnp.arange(v, dtype=jnp.int32),
                          side="right") - 1
  at = jnp.maximum(last, 0)
  present = (last >= 0) & (ids[at] == jnp.arange(v))
  flat = operand.reshape(v, -1)
  total = jnp.where(present[:, None], flat + runs[at], flat)
  return total.reshape(operand.shape)


_HIGHER_ORDER = {
    "pjit": _Rules._inline,
    "jit": _Rules._inline,
    "closed_call": _Rules._inline,
    "core_call": _Rules._inline,
    "custom_jvp_call": _Rules._inline,
    "checkpoint": _Rules._checkpoint,
    "remat": _Rules._checkpoint,
    "remat2": _Rules._checkpoint,
    "scan": _Rules._scan,
    "while": _Rules._while,
    "cond": _Rules._cond,
    "shard_map": _Rules._shard_map,
}
