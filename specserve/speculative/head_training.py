"""Training an EAGLE-3 head on its target (torch autograd), with EAGLE-3's training-time test.

One sequence of tokens x_0..x_{T-1} gives, from ONE target forward (no gradient), the
tapped states aux_i and the target's own next token y_i = argmax p(. | x_0..x_i). The head
is then unrolled `steps` times, as it drafts:

    step 0:  row i reads (x_{i+1}, fc(aux_i))              and predicts y_{i+1}
    step j:  row i reads (x_{i+1+j}, prenorm_{j-1, i})      and predicts y_{i+1+j}

Step j's row i sits at position i + j and attends to step 0's rows 0..i and to its own
rows of steps 1..j (what the head's cache holds when it drafts its j-th token), so the
head learns from its own earlier outputs (the "training-time test"). The loss is the
cross-entropy over the draft vocabulary against the target's distribution after each
prefix (its top-k, as EAGLE-3 learns from the target's probabilities), or against y alone.

Optionally (`feature_loss`, EAGLE-1's feature regression) step 0's pre-norm state at row i
is also pulled toward the fused target state of row i + 1: that state is what step 1 reads
in its place, so step 1 then sees what step 0 was trained on, one position on, instead of
a state that still points at step 0's own token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from specserve.batch import FlatBatch
from specserve.models.config import ModelConfig
from specserve.models.eagle3 import Eagle3Config, Eagle3Head, HeadCalibration, default_aux_layers
from specserve.models.layers.basic import apply_rotary
from specserve.models.layers.embedding import Embedding
from specserve.models.layers.taps import Taps
from specserve.models.registry import LanguageModel


def new_head(
    target: LanguageModel,
    draft_ids: torch.Tensor,
    norm_before_residual: bool = False,
    aux: tuple[int, ...] | None = None,
) -> Eagle3Head:
    """A head shaped like one of the target's layers, started where drafting is easiest: it
    reads the highest tapped layer and speaks through the target's final norm and LM head.
    norm_before_residual: its residual stream starts from the normed input state (see
    models/eagle3.py), not the raw one. aux: the target layers tapped (default vLLM's)."""
    t: ModelConfig = target.cfg
    layer = ModelConfig(
        arch="llama",
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=1,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        context_length=t.context_length,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta,
    )
    aux = aux or default_aux_layers(t.num_layers)
    cfg = Eagle3Config(layer, len(draft_ids), t.hidden_size, aux, norm_before_residual)
    top = max(range(len(aux)), key=aux.__getitem__)
    head = Eagle3Head(cfg)
    h = t.hidden_size
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
        head.fc.weight.zero_()
        head.fc.weight[:, top * h : (top + 1) * h] = torch.eye(h)
        head.attn.o.weight.mul_(0.1)
        head.mlp.down.weight.mul_(0.1)
        head.norm.weight.copy_(target.norm.weight.float())
        head.lm_head.weight.copy_(lm_head_rows(target.lm_head, draft_ids, h))
        head.d2t.copy_(draft_ids)
    return head


def lm_head_rows(lm_head: torch.nn.Module, ids: torch.Tensor, hidden: int) -> torch.Tensor:
    """Rows `ids` of the LM head's weight as float32, whatever kernel holds it: a quantized
    head has no float weight, and oneDNN's packed one is no dense matrix, so their rows are
    read back by applying the head to the unit vectors."""
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.layout == torch.strided:
        return weight.float()[ids]
    eye = torch.eye(hidden, dtype=torch.float32, device=ids.device)
    return lm_head(eye).float().T[ids]


@dataclass
class TargetRows:
    """One sequence as the head trains on it: tokens [T], tapped states [T, 3H], the
    target's next token after each prefix [T]."""

    tokens: torch.Tensor
    aux: torch.Tensor
    labels: torch.Tensor
    start: int = 0  # the first draft row scored (an answer's rows before its reply are not)
    # the target's k likeliest next tokens after each prefix [T, k] and their probabilities
    soft_ids: torch.Tensor | None = None
    soft_p: torch.Tensor | None = None


@torch.no_grad()
def target_rows(
    target: LanguageModel, tokens: list[int], layers: tuple[int, ...], start: int = 0, top: int = 0
) -> TargetRows:
    """One plain forward of the target over the sequence, its layers tapped; with `top`,
    its `top` likeliest next tokens after each prefix are kept too (soft labels)."""
    device = target.norm.weight.device
    cache = target.new_cache(1, len(tokens))
    batch = FlatBatch.build([0], [0], [len(tokens)], device)
    ids = torch.tensor(tokens, device=device)
    taps = Taps(layers)
    hidden = target(ids, batch, cache, taps=taps)
    aux = taps.out.float()
    logits = target.logits(hidden)
    rows = TargetRows(ids, aux, logits.argmax(dim=-1), start)
    if top > 0:
        p, rows.soft_ids = torch.softmax(logits.float(), dim=-1).topk(top, dim=-1)
        rows.soft_p = p
    return rows


def _unrolled_attention(
    head: Eagle3Head, x: torch.Tensor, *, j: int, kv: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Step j's attention: row i over step 0's rows 0..i and its own rows of steps 1..j.
    x [T, 2H]; kv: the keys and values of the steps before (this step's are appended)."""
    a = head.attn
    n = x.shape[0]
    pos = torch.arange(n, device=x.device) + j
    cos, sin = a.rope.cos_sin(pos, x.dtype)
    q = apply_rotary(a.q(x).view(n, a.num_heads, a.head_dim), cos, sin)
    k = apply_rotary(a.k(x).view(n, a.num_kv_heads, a.head_dim), cos, sin)
    kv.append((k, a.v(x).view(n, a.num_kv_heads, a.head_dim)))
    rep = a.num_heads // a.num_kv_heads
    ks = [k.repeat_interleave(rep, dim=1) for k, _ in kv]
    vs = [v.repeat_interleave(rep, dim=1) for _, v in kv]
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    s0 = torch.einsum("ihd,khd->hik", q, ks[0]) * a.scale
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [torch.einsum("ihd,ihd->hi", q, k)[..., None] * a.scale for k in ks[1:]]
    w = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
    out = torch.einsum("hik,khd->ihd", w[..., :n], vs[0])
    for m, v in enumerate(vs[1:]):
        out = out + w[..., n + m, None].transpose(0, 1) * v
    return a.o(out.reshape(n, -1))


@dataclass
class Unrolled:
    """The head unrolled over one sequence: per step j, (draft-vocabulary logits
    [T - 1 - j, Vd], target labels [T - 1 - j]); the fused target states [T - 1, H] and
    step 0's pre-norm states [T - 1, H] (for the feature loss)."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    fused: torch.Tensor
    prenorm0: torch.Tensor | None


def unrolled(head: Eagle3Head, embed: Embedding, rows: TargetRows, steps: int) -> Unrolled:
    n = rows.tokens.shape[0]
    with torch.no_grad():
        e = embed(rows.tokens).float()
    fused = g = head.fuse(rows.aux[: n - 1])
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    out, prenorm0 = [], None
    for j in range(min(steps, n - 1)):
        m = n - 1 - j  # rows whose token x_{i+1+j} and label y_{i+1+j} exist
        g, kv = g[:m], [(k[:m], v[:m]) for k, v in kv]
        attend = partial(_unrolled_attention, head, j=j, kv=kv)
        normed, g = head.layer(e[1 + j : 1 + j + m], g, attend)
        if j == 0:
            prenorm0 = g
        out.append((head.lm_head(normed), rows.labels[1 + j : 1 + j + m]))
    return Unrolled(out, fused, prenorm0)


def unrolled_logits(
    head: Eagle3Head, embed: Embedding, rows: TargetRows, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step j: (draft-vocabulary logits [T - 1 - j, Vd], target labels [T - 1 - j])."""
    return unrolled(head, embed, rows, steps).pairs


def feature_loss(u: Unrolled, start: int = 0) -> torch.Tensor | None:
    """Step 0's pre-norm state at row i against the fused target state of row i + 1 (held
    fixed), as a mean squared error relative to that state's own mean square, so its scale
    does not depend on the model's hidden size or the norm of its states."""
    if u.prenorm0 is None or u.prenorm0.shape[0] < start + 2:
        return None
    want = u.fused[start + 1 :].detach()
    got = u.prenorm0[start : start + want.shape[0]]
    return (got - want).pow(2).mean() / want.pow(2).mean().clamp(min=1e-12)


def ttt_loss(
    head: Eagle3Head,
    t2d: torch.Tensor,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    rows: TargetRows | None = None,
    weights: Sequence[float] | None = None,
) -> torch.Tensor:
    """Cross-entropy of every unrolled step against the target in the draft vocabulary
    (t2d: target id -> draft id, -1 outside it): against the target's distribution where
    `rows` holds its top tokens (EAGLE-3's soft labels, which say more per row than the
    argmax alone), else against its argmax (labels outside are skipped). Steps are weighted
    alike (their mean), or step j by weights[j]."""
    losses, scale = [], []  # each step's loss and its weight
    for j, (logits, labels) in enumerate(pairs):
        if rows is not None and rows.soft_ids is not None and rows.soft_p is not None:
            at = slice(1 + j, 1 + j + logits.shape[0])
            loss = _soft_cross_entropy(logits, t2d[rows.soft_ids[at]], rows.soft_p[at])
        else:
            loss = _hard_cross_entropy(logits, t2d[labels])
        if loss is not None:
            losses.append(loss)
            scale.append(weights[j] if weights is not None else 1.0)
    if not losses:
        return torch.zeros((), requires_grad=True)
    total = torch.stack([w * loss for w, loss in zip(scale, losses, strict=True)]).sum()
    return total if weights is not None else total / len(losses)


def _hard_cross_entropy(logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor | None:
    keep = draft >= 0
    return F.cross_entropy(logits[keep], draft[keep]) if keep.any() else None


def _soft_cross_entropy(
    logits: torch.Tensor, draft: torch.Tensor, p: torch.Tensor
) -> torch.Tensor | None:
    """logits [m, Vd]; draft ids [m, k] (-1 outside the draft vocabulary), p [m, k]: the
    target's top-k mass inside the draft vocabulary, renormalised per row."""
    p = p * (draft >= 0)
    mass = p.sum(dim=-1)
    keep = mass > 0
    if not keep.any():
        return None
    p = p[keep] / mass[keep, None]
    logp = torch.log_softmax(logits[keep].float(), dim=-1).gather(-1, draft[keep].clamp(min=0))
    return -(p * logp).sum(dim=-1).mean()


def acceptance_counts(
    head: Eagle3Head, pairs: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[int], list[int]]:
    """Per draft position j: (rows where positions 0..j were all right, rows where 0..j-1
    were): a greedy draft's chance to be kept at j, given it got there."""
    n = pairs[-1][0].shape[0] if pairs else 0
    ok = torch.ones(n, dtype=torch.bool)
    kept, reached = [], []
    for logits, labels in pairs:
        right = (head.d2t[logits.argmax(dim=-1)] == labels)[:n]
        reached.append(int(ok.sum()))
        ok = ok & right
        kept.append(int(ok.sum()))
    return kept, reached


def confidence_counts(
    head: Eagle3Head,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    bounds: Sequence[float],
    p_min: float,
) -> HeadCalibration:
    """Over the rows of one sequence, as a greedy draft is made and verified: the first
    token kept or not per class of the head's probability for it (split at `bounds`, each
    bound opening the class above it), and each later token, where the draft got there
    (every earlier one right and past p_min) and it passed p_min itself, kept or not."""
    n = pairs[-1][0].shape[0] if pairs else 0
    classes = len(bounds) + 1
    first_kept, first_rows = [0] * classes, [0] * classes
    later_kept = later_rows = 0
    alive = torch.ones(n, dtype=torch.bool)
    for j, (logits, labels) in enumerate(pairs):
        p, best = torch.softmax(logits[:n].float(), dim=-1).max(dim=-1)
        right = head.d2t[best] == labels[:n]
        if j == 0:
            cls = torch.bucketize(p, torch.tensor(bounds, dtype=p.dtype), right=True)
            for c in range(classes):
                first_rows[c] += int((cls == c).sum())
                first_kept[c] += int(((cls == c) & right).sum())
        else:
            alive = alive & (p >= p_min)
            later_rows += int(alive.sum())
            later_kept += int((alive & right).sum())
        alive = alive & right
    return HeadCalibration(
        tuple(bounds), tuple(first_kept), tuple(first_rows), p_min, later_kept, later_rows
    )
