"""Activation bytes per token: what autograd saves for backward, layer by layer.

The model follows the HF implementations op by op (what each op's backward needs), after
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", whose
GPT layer saves ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit with dropout. HF layers differ from the
paper's: RMSNorm upcasts to fp32, SwiGLU saves four ``f``-wide tensors, GQA saves smaller K/V,
SDPA (flash / memory-efficient / CPU flash) saves the output and an fp32 log-sum-exp instead of
the ``s x s`` scores. Terms are bytes per token; the caller multiplies by ``b * s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit._units import ordinal
from batchfit.memory.formulas._regime import Regime as Regime
from batchfit.memory.formulas.loss import kept_logit_bytes, loss_activations
from batchfit.memory.types import Line
from batchfit.models import Architecture, ModelInfo
from batchfit.spec import TrainingSetup

# Leaf names of each linear role, per model type (peft matches targets by these names).
ROLE_LEAVES: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {"qkv": ("c_attn",), "o": ("c_proj",), "up": ("c_fc",), "down": ("c_proj",)},
    "bert": {
        "qkv": ("query", "key", "value"),
        "o": ("dense",),
        "up": ("dense",),
        "down": ("dense",),
    },
    "distilbert": {
        "qkv": ("q_lin", "k_lin", "v_lin"),
        "o": ("out_lin",),
        "up": ("lin1",),
        "down": ("lin2",),
    },
    "t5": {"qkv": ("q", "k", "v"), "o": ("o",), "up": ("wi", "wi_0", "wi_1"), "down": ("wo",)},
    "opt": {
        "qkv": ("q_proj", "k_proj", "v_proj"),
        "o": ("out_proj",),
        "up": ("fc1",),
        "down": ("fc2",),
    },
    "phi3": {
        "qkv": ("qkv_proj",),
        "o": ("o_proj",),
        "up": ("gate_up_proj",),
        "down": ("down_proj",),
    },
    "gpt_neox": {
        "qkv": ("query_key_value",),
        "o": ("dense",),
        "up": ("dense_h_to_4h",),
        "down": ("dense_4h_to_h",),
    },
    "llama": {
        "qkv": ("q_proj", "k_proj", "v_proj"),
        "o": ("o_proj",),
        "up": ("gate_proj", "up_proj"),
        "down": ("down_proj",),
    },
}
for _alias, _base in (
    ("roberta", "bert"),
    ("xlm-roberta", "bert"),
    ("camembert", "bert"),
    ("electra", "bert"),
    ("mt5", "t5"),
    ("umt5", "t5"),
):
    ROLE_LEAVES[_alias] = ROLE_LEAVES[_base]
ROLES = ("qkv", "o", "up", "down")
# Gemma-2's logit soft-capping and T5's relative position bias are eager-only in transformers:
# asked for SDPA, they run eager attention.
EAGER_ONLY_TYPES = frozenset({"gemma2", "t5", "mt5"})
# Python-level GELU (NewGELUActivation: 0.5*x*(1+tanh(c*(x+0.044715*x^3)))) saves x, tanh(.),
# 0.5*x and 1+tanh(.) for backward; F.gelu saves only its input.
_PYTHON_GELUS = frozenset({"gelu_new", "gelu_fast", "gelu_pytorch"})


def role_leaves(model_type: str) -> dict[str, tuple[str, ...]]:
    return ROLE_LEAVES.get(model_type, ROLE_LEAVES["llama"])


def trainable_roles(model_type: str, lora_targets: tuple[str, ...] | None) -> dict[str, bool]:
    """Which linears save their input: all when fully trained, LoRA-targeted ones otherwise.

    A frozen linear's backward needs only its weight, not its input (aten linear backward).
    """
    if lora_targets is None:
        return dict.fromkeys(ROLES, True)
    leaves = role_leaves(model_type)
    wanted = set(lora_targets)
    return {role: bool(wanted & set(leaves[role])) for role in ROLES}


def norm_term(arch: Architecture, rg: Regime) -> tuple[str, float]:
    """The label and bytes per token a normalisation layer saves for backward."""
    h = arch.hidden_size
    if arch.norm == "rmsnorm":
        # HF RMSNorm: x.to(fp32) saved by pow/mul, x*rsqrt(var) cast back saved by weight*.
        return "rmsnorm: fp32 input + normalised", 4 * h + rg.stream_bytes * h
    # nn.LayerNorm saves its input (plus per-row mean/rstd).
    return "layernorm input", rg.stream_bytes * h + 8


def _attention(
    arch: Architecture,
    rg: Regime,
    impl: str,
    seq_len: int,
    roles: dict[str, bool],
    kv_tokens_ratio: float = 1.0,
) -> list[tuple[str, float]]:
    e, h, a = rg.compute_bytes, arch.hidden_size, arch.num_heads
    qd = a * arch.head_dim
    kvd = arch.num_kv_heads * arch.head_dim
    terms: list[tuple[str, float]] = []
    name, size = norm_term(arch, rg)
    terms.append((name, size))
    if roles["qkv"]:
        terms.append(("q/k/v projection input", e * h))
    # SDPA / eager both keep q, k, v (after rotary); GQA with enable_gqa keeps K/V un-repeated.
    terms.append(("q, k, v", e * (qd + 2 * kvd * kv_tokens_ratio)))
    if impl in ("sdpa", "flash"):
        terms.append(("attention output + fp32 log-sum-exp", e * qd + 4 * a))
    elif impl == "math":
        # SDPA's math path (CPU SDPA with dropout): softmax output, a float dropout mask and
        # the dropped probabilities, all in the compute dtype (_safe_softmax + bernoulli_).
        probs = 3 * e if arch.attention_dropout > 0 else e
        terms.append((f"SDPA math path: {probs:g} B x heads x seq", probs * a * seq_len))
        if roles["o"]:
            terms.append(("attention context (contiguous copy)", e * qd))
    else:
        probs = 4 + (e if e != 4 else 0)  # fp32 softmax, then its cast to the compute dtype
        if arch.attention_dropout > 0:
            probs += 1 + e  # dropout mask (bool) and the dropped-out probabilities
        if arch.model_type == "gemma2":
            probs += 2 * e  # logit soft-capping: tanh output and scaled scores
        terms.append((f"eager scores: {probs:g} B x heads x seq", probs * a * seq_len))
        if roles["o"]:
            terms.append(("attention context (contiguous copy)", e * qd))
    if arch.hidden_dropout > 0:
        terms.append(("dropout mask after attention", h))
    if arch.model_type == "gemma2":
        name, size = norm_term(arch, rg)
        terms.append(("post-attention " + name, size))
    return terms


def _mlp(arch: Architecture, rg: Regime, roles: dict[str, bool]) -> list[tuple[str, float]]:
    e, h, f = rg.compute_bytes, arch.hidden_size, arch.intermediate_size
    terms: list[tuple[str, float]] = []
    name, size = norm_term(arch, rg)
    terms.append((name, size))
    routed = max(arch.experts_per_token, 1)
    if roles["up"]:
        terms.append(("MLP input", e * h * routed))
    if arch.gated_mlp:
        # gate output (saved by act), act(gate) and up output (saved by the product).
        inner, label = 3.0, "gate, act(gate), up"
    elif arch.activation in _PYTHON_GELUS:
        inner, label = 4.0, "GELU (python): x, tanh, x/2, 1+tanh"
        if rg.cuda_autocast:
            # CUDA autocast upcasts pow(x, 3): tanh(.) and 1 + tanh(.) are kept in fp32.
            inner, label = (2 + 4 + 4 + 2) / e, "GELU (python, CUDA autocast): tanh in fp32"
    elif arch.activation == "relu":
        if arch.model_type in ("t5", "mt5", "umt5") and arch.hidden_dropout > 0:
            inner, label = 1 + 1 / e, "relu output + dropout mask"
        else:
            # relu saves its output, the very tensor the down projection saves.
            inner, label = (0.0 if roles["down"] else 1.0), "relu output"
    else:
        inner, label = 1.0, "activation input"
    terms.append((label, inner * (rg.mlp_bytes or e) * arch.intermediate_size * routed))
    if roles["down"]:
        terms.append(("down-projection input", e * f * routed))
    if arch.num_experts:
        terms.append(("expert gather / scatter", 2 * e * h * routed + 4 * arch.num_experts))
    if arch.hidden_dropout > 0:
        terms.append(("dropout mask after MLP", h))
    if arch.model_type == "gemma2":
        name, size = norm_term(arch, rg)
        terms.append(("post-MLP " + name, size))
    return terms


def lora_terms(
    arch: Architecture, targets: tuple[str, ...], rank: int, dropout: float
) -> list[tuple[str, float]]:
    """Bytes per token a layer's LoRA adapters keep: ``lora_B`` saves ``lora_A``'s output
    (rank wide, fp32 adapters); with ``lora_dropout`` a dropped copy of the input (fp32, as
    peft casts it to the adapter dtype) and its mask are kept for ``lora_A``.
    """
    leaves = role_leaves(arch.model_type)
    inputs = {
        "qkv": arch.hidden_size,
        "o": arch.num_heads * arch.head_dim,
        "up": arch.hidden_size,
        "down": arch.intermediate_size,
    }
    terms: list[tuple[str, float]] = []
    for role in ROLES:
        hit = [leaf for leaf in leaves[role] if leaf in targets]
        if not hit:
            continue
        per_module = 4 * rank + ((4 + 1) * inputs[role] if dropout > 0 else 0)
        terms.append((f"LoRA on {','.join(hit)}", per_module * len(hit)))
    return terms


def layer_terms(
    arch: Architecture,
    rg: Regime,
    impl: str,
    seq_len: int,
    roles: dict[str, bool],
    cross_attention: bool = False,
) -> list[tuple[str, float]]:
    """Bytes per token one transformer layer keeps for backward, as labelled terms."""
    terms = _attention(arch, rg, impl, seq_len, roles)
    if cross_attention:
        terms += [
            ("cross-attention " + k, v) for k, v in _attention(arch, rg, impl, seq_len, roles)
        ]
    return terms + _mlp(arch, rg, roles)


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch at the two moments of backward, with their lines."""

    at_backward_start: float  # everything saved, the loss's buffers: activations' own peak
    at_backward_end: float  # with checkpointing, one recomputed layer; else all freed
    lines: tuple[Line, ...]
    # with checkpointing, backward in the top layer: every other checkpointed input still held
    # beside the top layer's recomputed activations (the trace's "in the top layer" moment)
    at_backward_top: float = 0.0


@dataclass(frozen=True)
class _Stack:
    """Bytes one encoder (or decoder-only) layer and one decoder layer keep, for all tokens."""

    terms: list[tuple[str, float]]  # per token, of an encoder / decoder-only layer
    per_layer: float
    decoder_layer: float  # 0 unless encoder-decoder


def step_activations(
    model: ModelInfo,
    setup: TrainingSetup,
    rg: Regime,
    *,
    on_cpu: bool,
    micro_batch_size: int,
    seq_len: int,
    lora_targets: tuple[str, ...] | None,
) -> Activations:
    """What one micro-batch's forward keeps for backward (``setup`` resolved).

    ``lora_targets`` is None when every parameter trains.
    """
    arch, tokens = model.arch, micro_batch_size * seq_len
    stack = _stack(arch, setup, rg, on_cpu, seq_len, tokens, lora_targets)
    final, final_line = _final_norm(arch, rg, tokens, head_trainable=lora_targets is None)
    held, bwd_extra, loss_lines = loss_activations(
        model, setup, rg, tokens, seq_len, head_trainable=lora_targets is None
    )
    amp_copies = _amp_copies(
        model, rg, lora=lora_targets is not None and setup.frozen_dtype != "fp32"
    )
    if setup.grad_ckpt and setup.grad_ckpt_every:
        kept, copies, end, lines = _partly_checkpointed(
            arch, rg, stack, tokens, amp_copies, setup.grad_ckpt_every
        )
    elif setup.grad_ckpt:
        kept, copies, end, lines = _checkpointed(arch, rg, stack, tokens, amp_copies)
    else:
        kept, copies, end, lines = _stored(arch, stack, tokens, amp_copies)
    lines += [final_line, *loss_lines]
    # the top layer recomputes while the inputs kept for the layers below are still held
    top = kept + end if setup.grad_ckpt and end else 0.0
    end_extra, end_lines = _held_at_backward_end(
        model, rg, tokens, setup, full=lora_targets is None
    )
    end += end_extra
    lines += end_lines
    if amp_copies:
        why = "2 B per matmul weight, saved for backward"
        if setup.grad_ckpt:
            why = "one recomputed layer's weights at a time, 2 B each"
        lines.append(Line("activations", "autocast 16-bit weight copies", int(copies), why))
    head_copy = _kbit_head_copy(model, setup, rg)
    if head_copy:
        why = f"{model.arch.vocab_size:,} x {model.arch.hidden_size:,} x 2 B, saved for backward"
        lines.append(Line("activations", "autocast 16-bit copy of the fp32 head", head_copy, why))
    start = kept + final + held + bwd_extra + copies + head_copy
    return Activations(start, end, tuple(lines), at_backward_top=top)


def _kbit_head_copy(model: ModelInfo, setup: TrainingSetup, rg: Regime) -> int:
    """QLoRA after ``prepare_model_for_kbit_training``: autocast casts the fp32 output head to
    16-bit in forward, and the copy is saved for the input's gradient (the head is frozen)."""
    if not (setup.kbit_upcast and rg.amp) or model.task == "classification":
        return 0
    return 2 * model.arch.vocab_size * model.arch.hidden_size


def _stack(
    arch: Architecture,
    setup: TrainingSetup,
    rg: Regime,
    on_cpu: bool,
    seq_len: int,
    tokens: int,
    lora_targets: tuple[str, ...] | None,
) -> _Stack:
    roles = trainable_roles(arch.model_type, lora_targets)
    impl: str = setup.attention
    if on_cpu and impl in ("sdpa", "flash") and arch.attention_dropout > 0:
        impl = "math"  # CPU SDPA falls back to its math path when dropout is on (measured)
    terms = layer_terms(arch, rg, impl, seq_len, roles)
    if lora_targets is not None:
        terms += lora_terms(arch, lora_targets, setup.lora_rank, setup.lora_dropout)
    decoder_layer = 0.0
    if arch.family == "encoder-decoder":
        dec_terms = layer_terms(arch, rg, impl, seq_len, roles, cross_attention=True)
        decoder_layer = sum(v for _, v in dec_terms) * tokens
    return _Stack(terms, sum(v for _, v in terms) * tokens, decoder_layer)


def _final_norm(
    arch: Architecture, rg: Regime, tokens: int, *, head_trainable: bool
) -> tuple[float, Line]:
    """The final norm's saved input and, when the head trains, the head's input."""
    norm_name, norm_size = norm_term(arch, rg)
    final = (norm_size + (rg.compute_bytes * arch.hidden_size if head_trainable else 0)) * tokens
    line = Line(
        "activations",
        f"final {norm_name.split(':')[0]} + head input",
        int(final),
        f"{final / tokens:,.6g} B/token x {tokens:,} tokens",
    )
    return final, line


def _held_at_backward_end(
    model: ModelInfo, rg: Regime, tokens: int, setup: TrainingSetup, *, full: bool
) -> tuple[float, list[Line]]:
    """What the bottom of the stack's backward holds besides the gradients: the logits a
    ``keep-outputs`` loop keeps (counted in the loss's line), and a tied embedding's second
    gradient (the lookup's dense ``vocab x hidden``) and, unless autograd can add it in place,
    the sum of the two: out of place when the head's gradient came first as a view (fp32 and
    16-bit weights), in place under autocast, where it is a fresh fp32 cast (the trace, #10)."""
    if model.task == "classification":
        return 0.0, []
    arch = model.arch
    kept = setup.loop == "keep-outputs" and setup.loss != "fused"  # fused: no logits exist
    held = kept_logit_bytes(setup, rg) * arch.vocab_size * tokens if kept else 0.0
    if not (arch.tied_embeddings and full):
        return held, []
    # The fused loss hands the head a plain gradient it made in forward (not a view of a
    # matmul's output): autograd sums the second one into it in place, as under autocast.
    in_place = rg.amp or setup.loss == "fused"
    copies = 1 if in_place else 2
    tied = copies * arch.vocab_size * arch.hidden_size * rg.stream_bytes
    why = f"{copies} x {arch.vocab_size:,} x {arch.hidden_size:,} x {rg.stream_bytes} B"
    what = "tied embedding: second gradient" + ("" if in_place else " + their sum")
    return held + tied, [Line("activations", what, int(tied), why)]


def _amp_copies(model: ModelInfo, rg: Regime, *, lora: bool) -> float:
    """Autocast casts each matmul's fp32 weight to 16-bit; the copy is saved for backward.

    ``lora``: the frozen base is stored in 16-bit (no casts); an fp32 frozen base (Lightning
    ``bf16-mixed``) is cast like a trained one: each frozen linear's input needs a gradient,
    so its 16-bit weight copy is saved too."""
    if not rg.amp or lora:
        return 0.0
    copies = 2 * sum(g.total for g in model.params if g.is_matrix_weight)
    if model.arch.tied_embeddings and model.task != "classification":
        copies += 2 * model.arch.vocab_size * model.arch.hidden_size
    return copies


def _checkpointed(
    arch: Architecture, rg: Regime, stack: _Stack, tokens: int, amp_copies: float
) -> tuple[float, float, float, list[Line]]:
    """Layer inputs kept, weight copies, bytes at backward's end, lines: with checkpointing."""
    layers = arch.num_layers + arch.num_decoder_layers
    ckpt = rg.stream_bytes * arch.hidden_size * tokens * layers
    one_layer = max(stack.per_layer, stack.decoder_layer)
    layer_copies = amp_copies / max(layers, 1)
    end = one_layer + layer_copies + rg.stream_bytes * arch.hidden_size * tokens
    lines = [
        Line(
            "activations",
            "checkpointed layer inputs",
            int(ckpt),
            f"{layers} layers x {rg.stream_bytes} B x {arch.hidden_size:,} x {tokens:,} tokens",
        ),
        Line(
            "activations",
            "one layer recomputed in backward",
            int(one_layer),
            _layer_formula(stack.terms, tokens),
        ),
    ]
    return ckpt, layer_copies, end, lines


def _partly_checkpointed(
    arch: Architecture, rg: Regime, stack: _Stack, tokens: int, amp_copies: float, every: int
) -> tuple[float, float, float, list[Line]]:
    """Every ``every``-th layer checkpointed (its input kept, recomputed in backward), the
    others stored whole (their weight copies too); layers of both stacks averaged."""
    layers = arch.num_layers + arch.num_decoder_layers
    n_ckpt = layers // every
    n_full = layers - n_ckpt
    per_layer = (
        stack.per_layer * arch.num_layers + stack.decoder_layer * arch.num_decoder_layers
    ) / max(layers, 1)
    layer_input = rg.stream_bytes * arch.hidden_size * tokens
    kept = layer_input * n_ckpt + per_layer * n_full
    layer_copies = amp_copies / max(layers, 1)
    copies = layer_copies * n_full + (layer_copies if n_ckpt else 0.0)
    end = per_layer + layer_copies + layer_input if n_ckpt else 0.0
    lines = [
        Line(
            "activations",
            f"checkpointed layer inputs (every {ordinal(every)} layer)",
            int(layer_input * n_ckpt),
            f"{n_ckpt} layers x {rg.stream_bytes} B x {arch.hidden_size:,} x {tokens:,} tokens",
        ),
        Line(
            "activations",
            f"{n_full} layers stored whole",
            int(per_layer * n_full),
            f"{n_full} x {_layer_formula(stack.terms, tokens)}",
        ),
    ]
    return kept, copies, end, lines


def _stored(
    arch: Architecture, stack: _Stack, tokens: int, amp_copies: float
) -> tuple[float, float, float, list[Line]]:
    """Layer activations kept, weight copies, bytes at backward's end, lines: all stored."""
    n, n_dec = arch.num_layers, arch.num_decoder_layers
    layers_total = stack.per_layer * n + stack.decoder_layer * n_dec
    lines = [
        Line(
            "activations",
            f"{n} layers",
            int(stack.per_layer * n),
            f"{n} x {_layer_formula(stack.terms, tokens)}",
        )
    ]
    if stack.decoder_layer:
        lines.append(
            Line(
                "activations",
                f"{n_dec} decoder layers",
                int(stack.decoder_layer * n_dec),
                "self-attention + cross-attention + MLP per layer",
            )
        )
    return layers_total, amp_copies, 0.0, lines


def _layer_formula(terms: list[tuple[str, float]], tokens: int) -> str:
    per_token = sum(v for _, v in terms)
    return f"{per_token:,.0f} B/token x {tokens:,} tokens"
