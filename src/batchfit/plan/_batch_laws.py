"""The global batch (and peak LR) for pre-training, from published batch-size scaling laws.

Seed 000 says to pick the global batch "based on scaling laws"; two fitted laws answer it from
the model's size and the token budget, each on the grid it was fitted on:

- DeepSeek LLM (DeepSeek-AI 2024, arXiv:2401.02954, section 3.1): B_opt and η_opt as power laws
  of the compute C = M·D, with M the non-embedding FLOPs per token (attention included).
- Step Law (Li et al. 2025, "Predictable Scale: Part I", arXiv:2503.04715): B_opt from the
  tokens D alone, η_opt from the non-embedding parameters N and D.

Both are fits to decoder-only language models trained with AdamW from scratch; where they
disagree the answer is a range, and outside the grid a law was fitted on it says so. They say
nothing about fine-tuning, and a measured critical batch of your own run
(``Accumulator(noise_scale=True)``) outranks both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchfit._units import human_count
from batchfit.errors import UsageError
from batchfit.models import ModelInfo

# DeepSeek LLM's hyperparameter fits were made on compute budgets of 1e17 to 2e19 FLOPs
# (section 3.1, Figure 3); its own 7B and 67B runs (about 1e23 and 1e24 FLOPs) sat on the
# extrapolated lines. Past them nothing was checked.
DEEPSEEK_FIT_FLOPS = (1e17, 2e19)
DEEPSEEK_CHECKED_FLOPS = 1e24
# Step Law's largest grid: about 1B non-embedding parameters on 100B tokens (the paper's
# headline check, 0.094% from the grid's best loss).
STEP_LAW_MAX_PARAMS = 1e9
STEP_LAW_MAX_TOKENS = 1e11
# A law outside its fit by less than this factor is not flagged (the fits are rounded).
_SLACK = 1.1


@dataclass(frozen=True)
class LawAnswer:
    """One law's recommendation: the global batch in tokens and the peak learning rate."""

    name: str
    source: str
    batch_tokens: float
    learning_rate: float
    fitted_on: str
    inside_fit: bool
    note: str = ""  # why the answer is an extrapolation ("" inside the fit)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "batch_tokens": self.batch_tokens,
            "learning_rate": self.learning_rate,
            "fitted_on": self.fitted_on,
            "inside_fit": self.inside_fit,
            "note": self.note,
        }


def deepseek_llm(flops_per_token: float, train_tokens: float) -> LawAnswer:
    """DeepSeek LLM's fitted B_opt and η_opt for compute C = M·D (arXiv:2401.02954, eq. 1).

    Args:
        flops_per_token: M, the non-embedding training FLOPs per token (forward and backward,
            attention's score and weighted-sum terms included, the vocabulary excluded).
        train_tokens: D, the tokens of the whole run.

    Example:
        >>> a = deepseek_llm(1e9, 1e10)  # C = 1e19 FLOPs
        >>> round(a.batch_tokens), round(a.learning_rate, 6), a.inside_fit
        (478942, 0.001315, True)
    """
    _check_positive("flops per token", flops_per_token)
    _check_positive("train tokens", train_tokens)
    compute = flops_per_token * train_tokens
    batch = 0.2920 * compute**0.3271  # DeepSeek LLM 2024, eq. (1): B_opt = 0.2920·C^0.3271
    lr = 0.3118 * compute**-0.1250  # DeepSeek LLM 2024, eq. (1): η_opt = 0.3118·C^-0.1250
    lo, hi = DEEPSEEK_FIT_FLOPS
    note = ""
    if compute < lo / _SLACK:
        note = f"C = {compute:.3g} FLOPs is below the fit ({_sci(lo)} to {_sci(hi)} FLOPs)"
    elif compute > DEEPSEEK_CHECKED_FLOPS * _SLACK:
        note = (
            f"C = {compute:.3g} FLOPs is past the fit ({_sci(lo)} to {_sci(hi)} FLOPs) and past "
            "the paper's own 67B run (about 1e24), where the extrapolation was last checked"
        )
    elif compute > hi * _SLACK:
        note = (
            f"C = {compute:.3g} FLOPs is past the fit ({_sci(lo)} to {_sci(hi)} FLOPs), "
            "extrapolated as the paper did for its 7B and 67B runs, which agreed with it"
        )
    return LawAnswer(
        name="deepseek-llm",
        source="DeepSeek-AI 2024, DeepSeek LLM, arXiv:2401.02954, eq. (1)",
        batch_tokens=batch,
        learning_rate=lr,
        fitted_on=f"compute {_sci(lo)} to {_sci(hi)} FLOPs (C = M x D)",
        inside_fit=lo / _SLACK <= compute <= hi * _SLACK,
        note=note,
    )


def step_law(non_embedding_params: float, train_tokens: float) -> LawAnswer:
    """Step Law's B_opt(D) and η_opt(N, D) (Li et al. 2025, arXiv:2503.04715).

    Args:
        non_embedding_params: N, the parameters outside the embeddings and the output head.
        train_tokens: D, the tokens of the whole run.

    Example:
        >>> a = step_law(1e9, 1e11)
        >>> round(a.batch_tokens), round(a.learning_rate, 6), a.inside_fit
        (1107715, 0.001632, True)
    """
    _check_positive("non-embedding parameters", non_embedding_params)
    _check_positive("train tokens", train_tokens)
    n, d = non_embedding_params, train_tokens
    batch = 0.58 * d**0.571  # Step Law (Li et al. 2025): B_opt = 0.58·D^0.571 tokens
    lr = 1.79 * n**-0.713 * d**0.307  # Step Law (Li et al. 2025): η_opt = 1.79·N^-0.713·D^0.307
    past = []
    if n > STEP_LAW_MAX_PARAMS * _SLACK:
        past.append(f"N = {human_count(n)} parameters")
    if d > STEP_LAW_MAX_TOKENS * _SLACK:
        past.append(f"D = {human_count(d)} tokens")
    note = ""
    if past:
        note = (
            f"{' and '.join(past)} past the largest grid the law was fitted on (about 1B "
            "non-embedding parameters, 100B tokens)"
        )
    return LawAnswer(
        name="step-law",
        source="Li et al. 2025, Predictable Scale Part I (Step Law), arXiv:2503.04715",
        batch_tokens=batch,
        learning_rate=lr,
        fitted_on="dense models up to about 1B non-embedding parameters and 100B tokens",
        inside_fit=not past,
        note=note,
    )


@dataclass(frozen=True)
class BatchAdvice:
    """What the published laws recommend for one model and token budget."""

    model: str
    non_embedding_params: int
    flops_per_token: float
    train_tokens: int
    seq_len: int
    answers: tuple[LawAnswer, ...]
    warnings: tuple[str, ...] = ()

    @property
    def compute_flops(self) -> float:
        """C = M·D, the run's training compute as DeepSeek LLM counts it."""
        return self.flops_per_token * self.train_tokens

    @property
    def batch_tokens_range(self) -> tuple[float, float]:
        values = [a.batch_tokens for a in self.answers]
        return min(values), max(values)

    @property
    def learning_rate_range(self) -> tuple[float, float]:
        values = [a.learning_rate for a in self.answers]
        return min(values), max(values)

    @property
    def suggested_batch_tokens(self) -> int:
        """The laws' geometric mean, as a power-of-two number of ``seq_len`` samples."""
        lo, hi = self.batch_tokens_range
        samples = math.sqrt(lo * hi) / self.seq_len
        return int(self.seq_len * 2 ** max(0, round(math.log2(max(samples, 1.0)))))

    @property
    def suggested_learning_rate(self) -> float:
        """The laws' geometric mean (a peak LR for AdamW; tune around it)."""
        lo, hi = self.learning_rate_range
        return math.sqrt(lo * hi)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "non_embedding_params": self.non_embedding_params,
            "flops_per_token": self.flops_per_token,
            "train_tokens": self.train_tokens,
            "compute_flops": self.compute_flops,
            "seq_len": self.seq_len,
            "laws": [a.to_json() for a in self.answers],
            "batch_tokens_range": list(self.batch_tokens_range),
            "learning_rate_range": list(self.learning_rate_range),
            "suggested_global_batch_tokens": self.suggested_batch_tokens,
            "suggested_global_batch": self.suggested_batch_tokens // self.seq_len,
            "suggested_learning_rate": self.suggested_learning_rate,
            "warnings": list(self.warnings),
        }


def batch_laws(
    non_embedding_params: float,
    train_tokens: int,
    *,
    flops_per_token: float | None = None,
    seq_len: int = 4096,
    model: str = "",
) -> BatchAdvice:
    """Every law's global batch (tokens) and peak LR for ``N`` parameters trained on ``D`` tokens.

    Args:
        non_embedding_params: N, the parameters outside the embeddings and the output head.
        train_tokens: D, the tokens of the whole run.
        flops_per_token: M, non-embedding training FLOPs per token; default 6·N (Kaplan et al.
            2020, section 2.1), which leaves out attention's sequence-length term.
        seq_len: Tokens per sample, for the suggested batch in samples.
        model: A name for the output.

    Example:
        >>> a = batch_laws(1e9, 100_000_000_000, seq_len=2048)
        >>> [round(x.batch_tokens / 1e6, 2) for x in a.answers]
        [1.83, 1.11]
        >>> a.suggested_batch_tokens, a.suggested_batch_tokens // 2048
        (1048576, 512)
    """
    _check_positive("non-embedding parameters", non_embedding_params)
    _check_positive("--train-tokens", train_tokens)
    _check_positive("--seq-len", seq_len)
    m = 6.0 * non_embedding_params if flops_per_token is None else flops_per_token
    answers = (deepseek_llm(m, train_tokens), step_law(non_embedding_params, train_tokens))
    lo, hi = (a.batch_tokens for a in sorted(answers, key=lambda a: a.batch_tokens))
    warnings = [f"{a.name}: {a.note}" for a in answers if a.note]
    if hi / lo > 2:
        warnings.append(
            f"the laws disagree by {hi / lo:.1f}x on the batch ({human_count(lo)} to "
            f"{human_count(hi)} tokens): any batch in the range is as well supported; measure "
            "the run's noise scale (Accumulator(noise_scale=True)) to choose"
        )
    lr_lo, lr_hi = sorted(a.learning_rate for a in answers)
    if lr_hi / lr_lo > 2:
        warnings.append(
            f"the laws disagree by {lr_hi / lr_lo:.1f}x on the peak LR ({lr_lo:.3g} to "
            f"{lr_hi:.3g}): start a short sweep across the range"
        )
    return BatchAdvice(
        model=model,
        non_embedding_params=int(non_embedding_params),
        flops_per_token=m,
        train_tokens=int(train_tokens),
        seq_len=seq_len,
        answers=answers,
        warnings=tuple(warnings),
    )


def model_batch_laws(model: ModelInfo, train_tokens: int, seq_len: int = 4096) -> BatchAdvice:
    """:func:`batch_laws` for a resolved model: N and M counted from its parameter table.

    N leaves out the embeddings and the output head (Kaplan et al. 2020's non-embedding
    count, which Step Law uses); M is DeepSeek LLM's non-embedding FLOPs per token:
    6 x the matrix parameters a token passes through plus 6·layers·(heads x head_dim)·seq_len
    for attention (DeepSeek LLM section 3.2; 72·n·d² + 6·n·d·l for its own shape).

    Example:
        >>> from batchfit.models import resolve_model
        >>> a = model_batch_laws(resolve_model("gpt2"), 10_000_000_000, seq_len=1024)
        >>> a.non_embedding_params, f"{a.flops_per_token:.4g}"
        (85056000, '5.667e+08')
    """
    if model.arch.family == "vision":
        raise UsageError(
            f"{model.name} is an image model: the batch-size laws are fits to language-model "
            "pre-training"
        )
    _check_positive("--seq-len", seq_len)
    kinds = model.params_by_kind()
    arch = model.arch
    non_embedding = sum(v for k, v in kinds.items() if k not in ("embedding", "head"))
    matmul = float(sum(v for k, v in kinds.items() if k in ("attention", "mlp", "other")))
    warnings = list(model.warnings)
    experts = kinds.get("experts", 0)
    if experts and arch.num_experts:
        # a token passes through its routed share of the experts only
        matmul += experts * arch.experts_per_token / arch.num_experts
        non_embedding = int(
            non_embedding - experts + experts * arch.experts_per_token / arch.num_experts
        )
        warnings.append(
            "a mixture of experts: N and M count the parameters a token passes through (its "
            f"{arch.experts_per_token} of {arch.num_experts} experts); both laws were fitted "
            "on dense models"
        )
    layers = arch.num_layers + arch.num_decoder_layers
    # Kaplan et al. 2020 section 2.1: 2 FLOPs per weight forward, 4 backward = 6 per token
    # DeepSeek LLM 2024 section 3.2: attention adds 6·n_layer·d_attn·l_seq per token
    m = 6.0 * matmul + 6.0 * layers * arch.num_heads * arch.head_dim * seq_len
    if model.task != "causal-lm" or arch.family != "decoder":
        warnings.append(
            f"{model.name} is trained as {model.task}: both laws are fits to decoder-only "
            "causal language-model pre-training"
        )
    advice = batch_laws(
        non_embedding, train_tokens, flops_per_token=m, seq_len=seq_len, model=model.name
    )
    return BatchAdvice(**{**advice.__dict__, "warnings": (*warnings, *advice.warnings)})


def _sci(value: float) -> str:
    """``1e17``, ``2e19``: a power of ten as papers write it."""
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise UsageError(f"{name} must be a positive number, got {value}")
