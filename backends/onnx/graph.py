"""The spec's attention as an ONNX graph around the standard ``Attention`` operator (opset 23/24).

The graph is written as an exporter writes it: the projections as ``MatMul`` + ``Add`` with
the weights stored as initializers in the row-sample layout ``(in, out)`` (``x @ W.T``), the
head split as ``Reshape`` + ``Transpose`` to the op's 4-D ``(B, H, N, d)`` layout, optional
QK-norm and rotary as primitive ops, then one ``Attention`` node, then the merge
(``Transpose`` + ``Reshape``) and the output projection. What the op takes and how:

* ``scale``: the op's float attribute. The op multiplies Q and K each by ``sqrt(scale)``, and
  both ONNX Runtime and onnx's ReferenceEvaluator take that square root in float32, even in a
  float64 graph (measured here: the float64 output equals the float64 reference with
  ``scale' = float32(sqrt(float32(scale)))**2`` to 2e-16 and is 2.8e-8 from the exact one).
  ``fold_scale=True`` multiplies Q by the scale in the graph's dtype and passes ``scale=1``;
* GQA: 4-D K and V with fewer heads (the op groups query head h on kv head h // G);
* the mask: the op's ``attn_mask``, bool (True = attend) or, with ALiBi or T5's bias, float
  (the bias where allowed, -inf where blocked), broadcast to (B, H, Nq, T);
* causality: ``is_causal=1`` where it is the only positional rule and the positions are the
  indices (the op's rule ``j <= i + past``), otherwise it is in the mask;
* the softcap: the op's ``softcap`` attribute (applied before the mask: the spec's order);
* the cache: ``past_key``/``past_value`` in, ``present_key``/``present_value`` out (decode);
* rotary: ``x * cos + (x @ R) * sin`` with full-width tables (1 and 0 past the rotated
  features) and a constant signed permutation ``R``: one form for the half, interleaved and
  partial styles and every frequency scaling (the tables come from `core.rotary`);
* QK-norm: RMSNorm written as ``Mul``/``ReduceMean``/``Add``/``Sqrt``/``Div``/``Mul``.

The sinks have no place in the op (its softmax has no extra logit), so they are refused.
Nothing here imports onnx at module import; `build` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.rotary import rotary_pairs
from mha_rosetta.core.variants import NormStep, norm_step

from .known import op_attributes

ONNX_DTYPES = ("float32", "float64")  # what ONNX Runtime's CPU Attention kernel runs here


@dataclass(frozen=True)
class GraphSpec:
    """What one graph computes: the config, the op's switches and the inputs it takes."""

    cfg: MHAConfig
    dtype: str
    opset: int = 23
    is_causal: bool = False
    mask: str | None = None  # None, "bool" or "float"
    rope: bool = False
    past: bool = False  # past_key/past_value inputs, present_key/present_value outputs
    past_split: int = 0  # > 0: the first keys go in as past_key/past_value, sliced in the graph (the op's offset)
    fold_scale: bool = False
    # (qk_matmul_output_mode, stage name): one more Attention node per entry, whose qk output is that stage
    # (the spec's numbering, onnx #7913: 0 scores, 1 after the softcap, 2 after softcap and mask, 3 weights)
    qk_modes: tuple[tuple[int, str], ...] = ()
    stages: bool = False  # every intermediate tensor as a graph output too


@dataclass
class _Builder:
    dtype: str
    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    count: int = 0

    def add(self, op: str, inputs: list[str], name: str | None = None, **attrs) -> str:
        """One node of one output, named ``name`` (a stage) or numbered; returns the output's name."""
        from onnx import helper

        self.count += 1
        output = name or f"{op.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def const(self, name: str, value: np.ndarray, dtype: str | None = None) -> str:
        from onnx import numpy_helper

        array = np.asarray(value, dtype=dtype or self.dtype)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray | None, prefix: str, name: str) -> str:
        """``x @ W.T + b``: the (out, in) weight stored transposed, (in, out), as exporters store nn.Linear."""
        y = self.add("MatMul", [x, self.const(f"{prefix}_weight_t", weight.T)], None if bias is not None else name)
        return y if bias is None else self.add("Add", [y, self.const(f"{prefix}_bias", bias)], name)

    def rms_norm(self, x: str, weight: np.ndarray, eps: float, prefix: str, name: str) -> str:
        """RMSNorm of the last axis: ``x / sqrt(mean(x**2) + eps) * w``, in primitive ops."""
        squares = self.add("Mul", [x, x])
        axes = self.const(f"{prefix}_axes", np.array([-1]), "int64")
        mean = self.add("ReduceMean", [squares, axes], keepdims=1)
        root = self.add("Sqrt", [self.add("Add", [mean, self.const(f"{prefix}_eps", np.array(eps))])])
        return self.add("Mul", [self.add("Div", [x, root]), self.const(f"{prefix}_weight", weight)], name)


def rotation_matrix(style: str, d_k: int, rope_dims: int) -> np.ndarray:
    """The signed permutation ``R`` (Dk, Dk) with ``(x @ R)[first] = -x[second]``, ``(x @ R)[second] = x[first]``."""
    first, second = rotary_pairs(style, rope_dims)
    matrix = np.zeros((d_k, d_k))
    matrix[second, first] = -1.0
    matrix[first, second] = 1.0
    return matrix


def full_tables(style: str, d_k: int, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`core.rotary` tables (1|B, N, r/2) -> full-width (1|B, 1, N, Dk): 1 and 0 past the rotated features."""
    first, second = rotary_pairs(style, 2 * cos.shape[-1])
    full_cos = np.ones((*cos.shape[:-1], d_k))  # (1|B, N, Dk), new
    full_sin = np.zeros((*sin.shape[:-1], d_k))
    for index in (first, second):
        full_cos[..., index] = cos
        full_sin[..., index] = sin
    return full_cos[:, None], full_sin[:, None]  # (1|B, 1, N, Dk) views: one table for every head


def _split(b: _Builder, x: str, heads: int, width: int, name: str) -> str:
    shape = b.const(f"{name}_shape", np.array([0, 0, heads, width]), "int64")
    return b.add("Transpose", [b.add("Reshape", [x, shape])], name, perm=[0, 2, 1, 3])  # (B, N, h*d) -> (B, h, N, d)


def _rms_norms(
    b: _Builder, step: NormStep, params: MHAParams, pair: tuple[str, str], eps: float, names: tuple[str, str]
) -> tuple[str, str]:
    """RMSNorm of (q, k) with ``step``'s weights (their `MHAParams` fields name their constants), named ``names``."""
    (q, k), (q_name, k_name) = pair, names
    q_w, k_w = step.weight("q"), step.weight("k")
    return b.rms_norm(q, getattr(params, q_w), eps, q_w, q_name), b.rms_norm(k, getattr(params, k_w), eps, k_w, k_name)


def _slice_past(b: _Builder, x: str, past: int, which: str) -> tuple[str, str]:
    """(the new keys, the past keys) of (B, Hkv, Nk, d): tokens ``past..`` and ``..past`` on axis 2, two copies."""
    axes = b.const(f"{which}_token_axis", np.array([2]), "int64")
    split = b.const(f"{which}_past_len", np.array([past]), "int64")
    zero, end = b.const(f"{which}_zero", np.array([0]), "int64"), b.const(f"{which}_end", np.array([2**62]), "int64")
    return b.add("Slice", [x, split, end, axes]), b.add("Slice", [x, zero, split, axes], f"past_{which}")


def _rotate(b: _Builder, x: str, which: str, rotation: str, name: str) -> str:
    turned = b.add("Mul", [b.add("MatMul", [x, rotation]), f"{which}_sin"])
    return b.add("Add", [b.add("Mul", [x, f"{which}_cos"]), turned], name)


def build(spec: GraphSpec, params: MHAParams):
    """(the `onnx.ModelProto` of ``spec`` with ``params`` as initializers in ``spec.dtype``, stage name -> output)."""
    from onnx import TensorProto, helper

    cfg, b = spec.cfg, _Builder(spec.dtype)
    elem = TensorProto.FLOAT if spec.dtype == "float32" else TensorProto.DOUBLE
    inputs = [helper.make_tensor_value_info(n, elem, ["B", f"N{n[-1]}", None]) for n in ("x_q", "x_k", "x_v")]
    q = b.linear("x_q", params.w_q, params.b_q, "q_proj", "q")  # (B, Nq, H*Dk)
    k = b.linear("x_k", params.w_k, params.b_k, "k_proj", "k")  # (B, Nk, Hkv*Dk)
    v = b.linear("x_v", params.w_v, params.b_v, "v_proj", "v")  # (B, Nk, Hkv*Dv)
    stages = {"q": q, "k": k, "v": v}
    step = norm_step(cfg)  # QK-norm's place and weight fields, from the registry (or None)
    normed: tuple[str, str] | None = None  # (q_normed, k_normed) with it
    if step is not None and not step.per_head:  # over the whole projection, then the same split
        q_src, k_src = _rms_norms(b, step, params, (q, k), cfg.norm_eps, ("q_proj_normed", "k_proj_normed"))
        normed = (
            _split(b, q_src, cfg.n_heads, cfg.d_k, "q_normed"),  # (B, H, Nq, Dk)
            _split(b, k_src, cfg.n_kv_heads, cfg.d_k, "k_normed"),  # (B, Hkv, Nk, Dk)
        )
    q_heads = _split(b, q, cfg.n_heads, cfg.d_k, "q_heads")  # (B, H, Nq, Dk)
    k_heads = _split(b, k, cfg.n_kv_heads, cfg.d_k, "k_heads")  # (B, Hkv, Nk, Dk): fewer heads = GQA
    v_heads = _split(b, v, cfg.n_kv_heads, cfg.d_v, "v_heads")  # (B, Hkv, Nk, Dv)
    stages.update(q_heads=q_heads, k_heads=k_heads, v_heads=v_heads)
    if step is not None and step.per_head:  # each head's features, after the split
        normed = _rms_norms(b, step, params, (q_heads, k_heads), cfg.norm_eps, ("q_normed", "k_normed"))
    q_in, k_in = q_heads, k_heads
    if normed is not None:
        q_in, k_in = normed
        stages.update(q_normed=q_in, k_normed=k_in)
    if spec.rope:
        rotation = b.const("rotation", rotation_matrix(cfg.rope, cfg.d_k, 2 * _half(cfg)))
        tables = [helper.make_tensor_value_info(f"{w}_{f}", elem, None) for w in "qk" for f in ("cos", "sin")]
        inputs += tables
        q_in, k_in = _rotate(b, q_in, "q", rotation, "q_rotated"), _rotate(b, k_in, "k", rotation, "k_rotated")
        stages.update(q_rotated=q_in, k_rotated=k_in)
    if spec.fold_scale:
        q_in = b.add("Mul", [q_in, b.const("scale", np.array(cfg.scale))], "q_scaled")
    attrs = {"scale": 1.0 if spec.fold_scale else float(cfg.scale), "is_causal": int(spec.is_causal)}
    attrs.update(op_attributes(cfg))  # the variants the op carries as attributes (`known.OP_ATTRIBUTES`)
    v_in = v_heads
    if spec.past_split:  # cached keys as the op's past: its causal rule is then j <= i + past (bottom-right)
        k_in, past_k = _slice_past(b, k_in, spec.past_split, "k")
        v_in, past_v = _slice_past(b, v_in, spec.past_split, "v")
    attention_inputs = [q_in, k_in, v_in, "attn_mask" if spec.mask else ""]
    if spec.mask:
        mask_type = TensorProto.BOOL if spec.mask == "bool" else elem
        inputs.append(helper.make_tensor_value_info("attn_mask", mask_type, None))
    outputs_named = ["context"]
    if spec.past:
        attention_inputs += ["past_key", "past_value"]
        inputs += [helper.make_tensor_value_info(n, elem, ["B", None, "P", None]) for n in ("past_key", "past_value")]
        outputs_named += ["present_key", "present_value"]
    elif spec.past_split:  # ORT's CPU kernel needs present_* named when past_* is given (measured, 1.32)
        attention_inputs += [past_k, past_v]
        outputs_named += ["present_key_split", "present_value_split"]
    while attention_inputs and attention_inputs[-1] == "":
        attention_inputs.pop()
    b.nodes.append(helper.make_node("Attention", attention_inputs, outputs_named, **attrs))  # (B, H, Nq, Dv)
    for mode, stage in spec.qk_modes:  # the fused node's insides, each shown by a node of its own
        present = [f"present_key_{mode}", f"present_value_{mode}"] if len(attention_inputs) > 4 else ["", ""]
        outputs = [f"context_mode_{mode}", *present, stage]  # Y (and present_*, with a past) must be named
        b.nodes.append(helper.make_node("Attention", attention_inputs, outputs, qk_matmul_output_mode=mode, **attrs))
        stages[stage] = stage
    merged = b.add("Transpose", ["context"], perm=[0, 2, 1, 3])  # (B, Nq, H, Dv)
    merged = b.add("Reshape", [merged, b.const("merged_shape", np.array([0, 0, cfg.context_width]), "int64")], "merged")
    stages.update(context="context", merged="merged")
    if cfg.attn_output_gate:  # after the Attention node, natural ONNX: MatMul (+ Add), Sigmoid, Mul
        stages["gate"] = b.add("Sigmoid", [b.linear("x_q", params.w_gate, params.b_gate, "gate_proj", None)], "gate")
        merged = b.add("Mul", [merged, "gate"], "gated")  # (B, Nq, H*Dv): what o_proj reads
    b_o = params.b_o if cfg.output_bias else None
    b.linear(merged, params.w_o, b_o, "o_proj", "output")  # (B, Nq, D)
    stages["output"] = "output"
    out_names = ["output"] + (["present_key", "present_value"] if spec.past else [])
    if spec.stages:
        out_names += [name for name in stages.values() if name not in out_names]
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in out_names]
    graph = helper.make_graph(b.nodes, "mha_rosetta_attention", inputs, outputs, b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", spec.opset)], producer_name="mha-rosetta")
    model.ir_version = min(model.ir_version, 10)  # what ONNX Runtime 1.32 reads
    return model, stages  # stage name -> the graph output that holds it


def _half(cfg: MHAConfig) -> int:
    from mha_rosetta.core.rotary import rotated_dims

    return rotated_dims(cfg) // 2


def opsets() -> tuple[int, ...]:
    """The opsets with an ``Attention`` op that the installed onnx knows: 23, and 24 where it has it."""
    import onnx.defs

    latest = onnx.defs.onnx_opset_version()
    return tuple(opset for opset in (23, 24) if opset <= latest)
