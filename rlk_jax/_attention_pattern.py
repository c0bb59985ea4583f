"""Softmax attention found in a jaxpr, so that ``batch_invariant`` can run
it on det_attention instead of its two products and a softmax.

What is recognised, equation by equation from a ``dot_general`` of q and k
to the ``dot_general`` of the probabilities and v (how Tunix's models,
``jax.nn.dot_product_attention``'s XLA route and hand-written einsum
attention trace):

- between the products: transposes and reshapes, float conversions,
  products or quotients by scalar literals (the softmax scale), and
  ``select_n`` against a very negative scalar fill (``jnp.where(mask, s,
  -big)``; the masks are and-ed);
- the softmax over the key axis: ``max``, ``sub``, ``exp``, ``sum``, ``div``
  (inline, or inside a ``custom_jvp`` function);
- every value in between used by this chain alone (a softmax whose
  probabilities are also returned, or kept for an outer autodiff, is left
  to the other rules).

Axes are followed as *atoms*: the batch, free and contracted dimensions of
the first product, which transposes permute and reshapes group. The key
axis is the softmax's; the query axis is the query-side free axis the mask
varies over; the batch atoms the mask varies over are the batch, the others
KV heads; the query's other free atoms are each KV head's group (GQA).
Atoms of size 1 are not followed (a batch of one, a decode step's single
row): where they sit changes no array's contents, so a row alone and in a
batch take the same route.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

# A fill at or below this hides its key: exp(fill - max) is 0 in f32 for
# any score a row can have.
_HIDDEN_FILL = -1e30
CALLS = ("pjit", "jit", "closed_call", "core_call")


@dataclasses.dataclass(frozen=True)
class Mask:
  """One ``select_n`` predicate: `source`'s axes map to atom tuples (None:
  broadcast), True keeps the score where `keep_when` is True."""
  source: object
  atoms: tuple
  keep_when: bool


@dataclasses.dataclass(frozen=True)
class Match:
  """One attention: its operands (jaxpr vars or literals), their axes as
  atom tuples, the roles of the atoms, and the equations it replaces."""
  q: object
  k: object
  v: object
  q_axes: tuple
  k_axes: tuple
  v_axes: tuple
  out_axes: tuple
  masks: tuple
  scale: float
  sizes: dict
  batch: tuple       # atoms the masks vary over: det_attention's batch
  query: object      # the query-row atom (None: one row)
  key: object
  heads: tuple       # KV heads
  group: tuple       # query heads per KV head
  dim: object
  dim_v: object
  replaced: frozenset  # equation indices computed by det_attention instead
  last: int            # the second product's index: where it is evaluated


# ----------------------------------------------------------------- axes

def _regroup(axes, sizes, shape):
  """Axes (atom tuples) after a reshape to `shape`, or None where it would
  split an atom."""
  atoms = [a for ax in axes for a in ax]
  out, i = [], 0
  for n in shape:
    group, prod = [], 1
    while prod < n and i < len(atoms):
      group.append(atoms[i])
      prod *= sizes[atoms[i]]
      i += 1
    if prod != n:
      return None
    out.append(tuple(group))
  return tuple(out) if i == len(atoms) else None


def atoms_of(x, axes, sizes, order):
  """`x` (axes given as atom tuples) with one axis per atom of `order`
  (size-1 atoms not in `axes` become size-1 axes)."""
  flat = [a for ax in axes for a in ax]
  x = x.reshape([sizes[a] for a in flat])
  missing = [a for a in order if a not in flat]
  x = x.reshape(x.shape + (1,) * len(missing))
  where = {a: i for i, a in enumerate(flat + missing)}
  return jnp.transpose(x, [where[a] for a in order])


# ------------------------------------------------------------- the graph

class _Graph:

  def __init__(self, jaxpr):
    self.eqns = jaxpr.eqns
    self.producer = {}
    self.users: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.outvars:
        self.producer[v] = i
      for v in eqn.invars:
        if isinstance(v, jex.Var):
          self.users.setdefault(v, []).append(i)
    for v in jaxpr.outvars:
      if isinstance(v, jex.Var):
        self.users.setdefault(v, []).append(-1)

  def only_user(self, v):
    """The one equation using `v` (None if several, or an output)."""
    users = self.users.get(v, [])
    return users[0] if len(users) == 1 and users[0] >= 0 else None

  def made_by(self, v):
    i = self.producer.get(v) if isinstance(v, jex.Var) else None
    return (i, self.eqns[i]) if i is not None else (None, None)


def _scalar_literal(v):
  if isinstance(v, jex.Literal) and np.ndim(v.val) == 0:
    return float(v.val)
  return None


def _fill_value(graph, v):
  """The scalar a select's other case broadcasts (None if not a literal)."""
  while True:
    lit = _scalar_literal(v)
    if lit is not None:
      return lit
    _, eqn = graph.made_by(v)
    if eqn is None or eqn.primitive.name not in ("broadcast_in_dim",
                                                 "convert_element_type"):
      return None
    v = eqn.invars[0]


def _masks_of(graph, pred, axes, keep_when):
  """The predicate as and-ed sources, each axis mapped to the score's
  atoms (None: broadcast); None where it is something else."""
  mapping = tuple(range(len(axes)))
  while True:
    _, eqn = graph.made_by(pred)
    name = eqn.primitive.name if eqn is not None else None
    if name == "broadcast_in_dim":
      operand = eqn.invars[0].aval
      out = eqn.outvars[0].aval
      mapping = tuple(
          None if (operand.shape[j] == 1 and out.shape[d] != 1) else mapping[d]
          for j, d in enumerate(eqn.params["broadcast_dimensions"]))
      pred = eqn.invars[0]
    elif name == "transpose":
      perm = eqn.params["permutation"]
      inverse = [0] * len(perm)
      for i, p in enumerate(perm):
        inverse[p] = mapping[i]
      mapping = tuple(inverse)
      pred = eqn.invars[0]
    elif name == "convert_element_type" and eqn.invars[0].aval.dtype == bool:
      pred = eqn.invars[0]
    elif name == "not":
      keep_when = not keep_when
      pred = eqn.invars[0]
    elif name == "and" and keep_when:
      found = []
      for operand in eqn.invars:
        sub = _masks_of(graph, operand, tuple(
            axes[m] if m is not None else () for m in mapping), True)
        if sub is None:
          return None
        found.extend(sub)
      return found
    else:
      break
  if (not isinstance(pred, (jex.Var, jex.Literal)) or pred.aval.dtype != bool
      or pred.aval.ndim != len(mapping)):
    return None
  return [Mask(pred, tuple(None if m is None else axes[m] for m in mapping),
               keep_when)]


def _softmax_end(graph, x):
  """The probabilities' var if `x` feeds only a last-axis softmax (inline
  or a custom_jvp function of it), else None. Returns (var, indices)."""
  users = graph.users.get(x, [])
  if len(users) == 1 and users[0] >= 0:
    eqn = graph.eqns[users[0]]
    if eqn.primitive.name == "custom_jvp_call":
      body = eqn.params["call_jaxpr"]
      body = body.jaxpr if isinstance(body, jex.ClosedJaxpr) else body
      inner = (_softmax_end(_Graph(body), body.invars[0])
               if len(eqn.invars) == 1 and len(eqn.outvars) == 1 else None)
      if inner is not None and inner[0] is body.outvars[0]:
        return eqn.outvars[0], {users[0]}
      return None
  shifted = _reduced_back(graph, x, "reduce_max", "sub",
                         ("max", "broadcast_in_dim", "stop_gradient",
                          "reshape"))
  if shifted is None:
    return None
  i_sub, seen = shifted
  i_exp = graph.only_user(graph.eqns[i_sub].outvars[0])
  if i_exp is None or graph.eqns[i_exp].primitive.name != "exp":
    return None
  normalised = _reduced_back(graph, graph.eqns[i_exp].outvars[0],
                             "reduce_sum", "div",
                             ("broadcast_in_dim", "reshape"))
  if normalised is None:
    return None
  i_div, more = normalised
  return graph.eqns[i_div].outvars[0], seen | more | {i_exp}


def _reduced_back(graph, x, reduce, combine, via):
  """`x`'s two uses as ``combine(x, via...(reduce(x, last axis)))`` (a
  softmax's ``x - max`` and ``e / sum``): (the combine's index, the
  equations), or None."""
  users = graph.users.get(x, [])
  if len(users) != 2 or min(users) < 0:
    return None
  by = {graph.eqns[i].primitive.name: i for i in users}
  if set(by) != {reduce, combine}:
    return None
  i_red, i_comb = by[reduce], by[combine]
  if (tuple(graph.eqns[i_red].params["axes"]) != (x.aval.ndim - 1,)
      or graph.eqns[i_comb].invars[0] is not x):
    return None
  seen = {i_red, i_comb}
  v = graph.eqns[i_red].outvars[0]
  while v is not graph.eqns[i_comb].invars[1]:
    i = graph.only_user(v)
    if i is None or graph.eqns[i].primitive.name not in via:
      return None
    seen.add(i)
    v = graph.eqns[i].outvars[0]
  return i_comb, seen


def _follow(graph, v, axes, sizes, replaced, scale=None, masks=None):
  """Walk `v`'s single users through layout ops (and, before the softmax,
  scalar scalings and mask selects): (last var, its axes, the user that
  stopped the walk, or None where `v` has several users); None where an
  atom would split or a select is not a mask's."""
  while True:
    i = graph.only_user(v)
    if i is None:
      return v, axes, None
    eqn = graph.eqns[i]
    name = eqn.primitive.name
    if name == "transpose":
      axes = tuple(axes[p] for p in eqn.params["permutation"])
    elif name == "reshape":
      if eqn.params.get("dimensions") is not None:
        return None
      axes = _regroup(axes, sizes, eqn.outvars[0].aval.shape)
      if axes is None:
        return None
    elif name == "convert_element_type":
      if not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return None
    elif name in ("mul", "div") and scale is not None:
      other = eqn.invars[1] if eqn.invars[0] is v else eqn.invars[0]
      c = _scalar_literal(other)
      if c is None or (name == "div" and eqn.invars[0] is not v) or c == 0:
        return None
      scale[0] *= c if name == "mul" else 1.0 / c
    elif name == "select_n" and masks is not None and len(eqn.invars) == 3:
      pred, case0, case1 = eqn.invars
      if case1 is v and case0 is not v:
        fill, keep_when = case0, True
      elif case0 is v and case1 is not v:
        fill, keep_when = case1, False
      else:
        return None
      value = _fill_value(graph, fill)
      if value is None or not value <= _HIDDEN_FILL:
        return None
      found = _masks_of(graph, pred, axes, keep_when)
      if found is None:
        return None
      masks.extend(found)
    else:
      return v, axes, i
    replaced.add(i)
    v = eqn.outvars[0]


def find(jaxpr, head_dims, dtypes) -> dict[int, Match]:
  """Every attention of `jaxpr` det_attention can take (head dim in
  `head_dims`, q/k/v of one dtype in `dtypes`), by its last equation."""
  graph = _Graph(jaxpr)
  found: dict[int, Match] = {}
  taken: set = set()
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name != "dot_general" or i in taken:
      continue
    m = _match(graph, i, head_dims, dtypes)
    if m is not None and not (m.replaced & taken):
      found[m.last] = m
      taken |= m.replaced
  return found


def _match(graph, i1, head_dims, dtypes) -> Match | None:
  d1 = graph.eqns[i1]
  (lc, rc), (lb, rb) = d1.params["dimension_numbers"]
  lhs, rhs = d1.invars
  if len(lc) != 1:
    return None
  sizes = {}

  def atom(name, size):
    sizes[name] = size
    return (name,) if size != 1 else ()

  la, ra = lhs.aval, rhs.aval
  lhs_axes = [None] * la.ndim
  rhs_axes = [None] * ra.ndim
  out_axes = []
  for j, (a, b) in enumerate(zip(lb, rb)):
    lhs_axes[a] = rhs_axes[b] = atom(("b", j), la.shape[a])
    out_axes.append(lhs_axes[a])
  lhs_axes[lc[0]] = rhs_axes[rc[0]] = atom("d", la.shape[lc[0]])
  for side, aval, axes in (("l", la, lhs_axes), ("r", ra, rhs_axes)):
    for j in range(aval.ndim):
      if axes[j] is None:
        axes[j] = atom((side, j), aval.shape[j])
        out_axes.append(axes[j])
  replaced = {i1}
  scale, masks = [1.0], []
  walked = _follow(graph, d1.outvars[0], tuple(out_axes), sizes, replaced,
                   scale, masks)
  if walked is None:
    return None
  x, x_axes, _ = walked
  soft = _softmax_end(graph, x)
  if soft is None or not masks or not x_axes or len(x_axes[-1]) != 1:
    return None
  p, seen = soft
  replaced |= seen
  key = x_axes[-1][0]
  if key[0] not in ("l", "r"):
    return None
  k_side = key[0]
  q_var, k_var = (rhs, lhs) if k_side == "l" else (lhs, rhs)
  q_axes, k_axes = (rhs_axes, lhs_axes) if k_side == "l" else (lhs_axes,
                                                                rhs_axes)
  if any(a[0] == k_side for ax in k_axes for a in ax if a != key):
    return None  # the keys have another free axis
  walked = _follow(graph, p, x_axes, sizes, replaced)
  if walked is None:
    return None
  p, p_axes, i2 = walked
  if i2 is None or graph.eqns[i2].primitive.name != "dot_general":
    return None
  d2 = graph.eqns[i2]
  (l2c, r2c), (l2b, r2b) = d2.params["dimension_numbers"]
  if d2.invars[0] is p and d2.invars[1] is not p:
    pc, vc, pb, vb, v_var, p_first = l2c, r2c, l2b, r2b, d2.invars[1], True
  elif d2.invars[1] is p and d2.invars[0] is not p:
    pc, vc, pb, vb, v_var, p_first = r2c, l2c, r2b, l2b, d2.invars[0], False
  else:
    return None
  if len(pc) != 1 or p_axes[pc[0]] != (key,):
    return None
  va = v_var.aval
  v_axes = [None] * va.ndim
  v_axes[vc[0]] = (key,)
  for a, b in zip(pb, vb):
    v_axes[b] = p_axes[a]
  v_free = [j for j in range(va.ndim) if v_axes[j] is None]
  if len(v_free) != 1:
    return None
  v_axes[v_free[0]] = atom("dv", va.shape[v_free[0]])
  p_free = [p_axes[j] for j in range(len(p_axes)) if j not in pc and j not in pb]
  batch_out = [p_axes[a] for a in pb]
  d2_out = (batch_out + p_free + [v_axes[v_free[0]]] if p_first
            else batch_out + [v_axes[v_free[0]]] + p_free)
  replaced.add(i2)

  # Roles.
  batch_atoms = [a for ax in out_axes for a in ax if a[0] == "b"]
  q_free = [a for ax in q_axes for a in ax if a[0] in ("l", "r")]
  carried = {a for m in masks for ax in m.atoms if ax for a in ax}
  if key not in carried or not carried <= set(batch_atoms) | set(q_free) | {
      key}:
    return None
  rows = [a for a in q_free if a in carried]
  if len(rows) > 1:
    return None
  query = rows[0] if rows else None
  batch = tuple(a for a in batch_atoms if a in carried)
  heads = tuple(a for a in batch_atoms if a not in carried)
  group = tuple(a for a in q_free if a != query)
  v_atoms = {a for ax in v_axes for a in ax}
  if v_atoms & set(q_free) or not set(batch_atoms) <= v_atoms:
    return None
  for m in masks:  # each mask axis must be whole atoms of batch, row, key
    for ax in m.atoms:
      if ax and len(ax) > 1:
        return None
  dim = "d"
  if sizes[dim] not in head_dims or sizes.get("dv", 0) != sizes[dim]:
    return None
  dts = {str(x.aval.dtype) for x in (q_var, k_var, v_var)}
  if len(dts) != 1 or dts.pop() not in dtypes:
    return None
  return Match(q_var, k_var, v_var, tuple(q_axes), tuple(k_axes),
               tuple(v_axes), tuple(d2_out), tuple(masks), float(scale[0]),
               dict(sizes), batch, query, key, heads, group, dim, "dv",
               frozenset(replaced), i2)


def evaluate(m: Match, q, k, v, mask_values, out_aval, attend):
  """The second product's output from det_attention: ``attend(q [B, T, Hq,
  D], k, v [B, S, Hkv, D], mask [B, T, S], scale)`` on the operands laid
  out by their atoms, and its result laid back out as the product's."""
  s = m.sizes
  size = lambda atoms: math.prod(s[a] for a in atoms)
  row = (m.query,) if m.query is not None else ()
  b, t = size(m.batch), size(row)
  qa = atoms_of(q, m.q_axes, s, [*m.batch, *row, *m.heads, *m.group, m.dim])
  ka = atoms_of(k, m.k_axes, s, [*m.batch, m.key, *m.heads, m.dim])
  va = atoms_of(v, m.v_axes, s, [*m.batch, m.key, *m.heads, m.dim_v])
  hq = size(m.heads) * size(m.group)
  mask = None
  for spec, value in zip(m.masks, mask_values):
    # Axes that carry no atom have size 1 (broadcast, or a size-1 atom).
    carried = tuple(ax for ax in spec.atoms if ax)
    value = jnp.asarray(value, bool).reshape([s_ax for ax in carried
                                              for s_ax in [size(ax)]])
    keep = atoms_of(value, carried, s, [*m.batch, *row, m.key])
    keep = keep if spec.keep_when else ~keep
    mask = keep if mask is None else mask & keep
  mask = jnp.broadcast_to(mask, [s[a] for a in (*m.batch, *row, m.key)])
  out = attend(qa.reshape(b, t, hq, s[m.dim]),
               ka.reshape(b, s[m.key], size(m.heads), s[m.dim]),
               va.reshape(b, s[m.key], size(m.heads), s[m.dim_v]),
               mask.reshape(b, t, s[m.key]), m.scale)
  out = out.reshape([s[a] for a in (*m.batch, *row, *m.heads, *m.group,
                                    m.dim_v)])
  order = [*m.batch, *row, *m.heads, *m.group, m.dim_v]
  want = [a for ax in m.out_axes for a in ax]
  out = jnp.transpose(out, [order.index(a) for a in want])
  return out.reshape(out_aval.shape).astype(out_aval.dtype)

