"""SCORER + CBR (tuyunbin/SCORER) re-implemented in plain PyTorch: the project's torch reference,
used by the parity tests and by ``python -m benchmarks.vs_pytorch --torch``.

Written from the notes in ``docs/official/`` (cited as §N below), not from any code:
§2.3 AddSpatialInfo, §2.5 caption mask / targets, §3.1 ``ChangeDetector``, §3.2 ``Speaker``,
§3.3 CBR (``generator``), §3.4 losses, §3.5 initialisation, §3.7 ``Speaker.sample``, and the
quirks of §3.10 (all the "R" ones are reproduced). Module and attribute names are chosen so that
``state_dict()`` keys, order and shapes equal Appendix A for the default (transformer.yaml) sizes.

Layouts (as in the official code):
  * image features: channels-first (B, C, H, W), C = 1026 on CLEVR-Change (1024 ResNet-101 layer3
    channels + the 2 AddSpatialInfo coordinates); H = W (the grid PE assumes it, §3.1 step 2);
  * tokens: batch-first (B, H*W, D), token t = W*i + j (row-major over the grid);
  * captions: int64 ids (B, Lt), START (2) at position 0, END (3) after the last word, 0 pads;
    ``masks`` float (B, Lt) = 1 on START..END (§2.5 item 5); targets ``labels_with_ignore``
    (B, Lt) int64, -1 where no loss applies (§2.5 item 6).
Everything is float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3  # §2.4
IGNORE_INDEX = -1  # §2.5 item 6, CrossEntropyLoss(ignore_index=-1)
UNK_LOG_PROB = -1e10  # §3.7 step 3
MASK_VALUE = -10000.0  # §3.2 step 1 / S-Q6: additive mask value of the Speaker
LOGIT_SCALE_MAX = math.log(100.0)  # §3.4: clamp so that exp(logit_scale) <= 100

SIM_WEIGHT = 0.1  # §3.4
CBR_WEIGHT = 0.001  # §3.4


# ------------------------------------------------------------------------------------------------
# Data-side helpers (§2.3, §2.5)
# ------------------------------------------------------------------------------------------------


def add_spatial_info(feats: Tensor) -> Tensor:
    """§2.3 AddSpatialInfo: (B, C, H, W) -> (B, C + 2, H, W).

    Channel C holds x = j*2/W - 1 (j = column), channel C + 1 holds y = i*2/H - 1 (i = row); the
    grid is asymmetric (it never reaches +1).
    """
    b, _, h, w = feats.shape
    xs = torch.arange(w, dtype=feats.dtype, device=feats.device) * 2.0 / w - 1.0
    ys = torch.arange(h, dtype=feats.dtype, device=feats.device) * 2.0 / h - 1.0
    x_chan = xs.view(1, 1, 1, w).expand(b, 1, h, w)
    y_chan = ys.view(1, 1, h, 1).expand(b, 1, h, w)
    return torch.cat([feats, x_chan, y_chan], dim=1)


def caption_mask(ids: Tensor) -> Tensor:
    """§2.5 item 5: float (B, L), 1 on the first k positions, k = number of non-zero ids."""
    length = (ids != PAD_ID).sum(dim=-1, keepdim=True)
    return (torch.arange(ids.shape[-1], device=ids.device)[None, :] < length).float()


def labels_with_ignore(ids: Tensor) -> Tensor:
    """§2.5 item 6: target[t] = ids[t + 1] inside the mask, else -1; the last position is -1."""
    mask = caption_mask(ids).bool()
    targets = ids.clone().long()
    targets[~mask] = IGNORE_INDEX
    pad = torch.full_like(targets[:, :1], IGNORE_INDEX)
    return torch.cat([targets[:, 1:], pad], dim=1)


def sinusoid_table(max_len: int, dim: int) -> Tensor:
    """§3.2 ``position_enc.pe`` (max_len, dim): row p has sin(p*f_k) on dim 2k and cos(p*f_k)
    on dim 2k + 1, f_k = exp(-(2k) * ln(10000) / dim); computed in float32."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    pe = torch.zeros(max_len, dim, dtype=torch.float32)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term[: dim // 2])
    return pe


class PositionalEncoding(nn.Module):
    """§3.2 ``core.position_enc``: the fixed sinusoid buffer ``pe`` (in the state_dict)."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        self.register_buffer("pe", sinusoid_table(max_len, dim))

    def forward(self, x: Tensor) -> Tensor:
        """x (B, Lt, dim) -> x + pe[:Lt]."""
        if x.shape[1] > self.pe.shape[0]:
            raise ValueError(f"sequence length {x.shape[1]} exceeds the {self.pe.shape[0]} PE rows")
        return x + self.pe[: x.shape[1]].unsqueeze(0)


def embed_image(
    img: nn.Module, w_embedding: nn.Embedding, h_embedding: nn.Embedding, x: Tensor
) -> Tensor:
    """§3.1 steps 1-3 (shared by DIRL, §4.1 step 1): 1x1 conv, + learned 2-D PE, flatten.

    x (B, C, H, W) -> tokens (B, H*W, D), token t = W*i + j, PE[:, i, j] = cat(w_emb[j], h_emb[i]).
    """
    b, _, h, w = x.shape
    if h != w:
        # §3.1 step 2: the official code repeats with W for both axes, so it assumes H = W.
        raise ValueError(f"the grid position embedding assumes H == W, got {h}x{w}")
    y = img(x)  # (B, D, H, W)
    cols = w_embedding(torch.arange(w, device=x.device))  # (W, D/2)
    rows = h_embedding(torch.arange(h, device=x.device))  # (H, D/2)
    pos = torch.cat(
        [cols.unsqueeze(0).expand(h, w, -1), rows.unsqueeze(1).expand(h, w, -1)], dim=-1
    )  # (H, W, D)
    y = y + pos.permute(2, 0, 1).unsqueeze(0)
    return y.flatten(2).transpose(1, 2)


def mtm_similarity(q: Tensor, k: Tensor) -> Tensor:
    """§3.1 step 4 (S-Q2): token-wise max matching over the batch, (B, L, D) x (B, M, D) -> (B, B).

    R[a, b, l, m] = <q[a, l], k[b, m]> over all D dims (heads summed before the max, no 1/sqrt(d));
    S[a, b] = 1/2 (mean_l max_m R + mean_m max_l R). The logit scale is applied by the caller.
    """
    r = torch.einsum("ald,bmd->ablm", q, k)
    return 0.5 * (r.max(dim=-1).values.mean(dim=-1) + r.max(dim=-2).values.mean(dim=-1))


def row_cross_entropy(s: Tensor) -> Tensor:
    """§3.4 ``CrossEn``: log_softmax over the last dim, take the diagonal, negate, mean."""
    return -torch.diagonal(F.log_softmax(s, dim=-1)).mean()


def caption_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """§3.2: ``nn.CrossEntropyLoss(ignore_index=-1)`` on (B*Lt, V) logits, mean over targets."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), ignore_index=IGNORE_INDEX
    )


# ------------------------------------------------------------------------------------------------
# Encoder ChangeDetector (§3.1)
# ------------------------------------------------------------------------------------------------


class ScorerAttention(nn.Module):
    """§3.1 step 4 ``Attention``: q/k/v projections, the MTM similarity with a learnable logit
    scale, multi-head reconstruction with no output projection, LN(ctx + q) (eps 1e-6)."""

    def __init__(self, dim: int = 512, heads: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.logit_scale = nn.Parameter(torch.ones([]))  # §3.1: init 1.0 (scale e)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(
        self, q_in: Tensor, kv_in: Tensor, with_similarity: bool = True
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """q_in (B, Lq, D), kv_in (B, Lk, D) -> (out (B, Lq, D), S (B, B) or None,
        head-mean attention probabilities (B, Lq, Lk))."""
        q, k, v = self.query(q_in), self.key(kv_in), self.value(kv_in)
        sim = self.logit_scale.exp() * mtm_similarity(q, k) if with_similarity else None
        b, lq, d = q.shape
        lk = k.shape[1]
        dh = d // self.heads
        qh = q.view(b, lq, self.heads, dh).transpose(1, 2)
        kh = k.view(b, lk, self.heads, dh).transpose(1, 2)
        vh = v.view(b, lk, self.heads, dh).transpose(1, 2)
        probs = F.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(dh), dim=-1)
        ctx = (self.dropout(probs) @ vh).transpose(1, 2).reshape(b, lq, d)
        # No output projection (§3.10 S-Q5 analogue in the encoder); residual with the input.
        return self.layer_norm(ctx + q_in), sim, probs.mean(dim=1)


class ScorerLayer(nn.Module):
    """One ``scorer.{l}`` entry (wrapper holding ``attention``, §3.1 step 4)."""

    def __init__(self, dim: int = 512, heads: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        self.attention = ScorerAttention(dim, heads, dropout)

    def forward(
        self, q_in: Tensor, kv_in: Tensor, with_similarity: bool = True
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """See :meth:`ScorerAttention.forward`."""
        return self.attention(q_in, kv_in, with_similarity)


class ChangeDetectorOutput(NamedTuple):
    """§3.1 outputs (memory, S1, S2, X1^0, X2^0)."""

    memory: Tensor  # (B, H*W, D) decoder memory (after embed_fc)
    sim_bef: Tensor  # (B, B) S1: last layer, before-tokens as queries, after-tokens as keys
    sim_aft: Tensor  # (B, B) S2: last layer, after-tokens as queries
    input_bef: Tensor  # (B, H*W, D) X1^0 (conv + PE, before the SCORER layers), feeds CBR
    input_aft: Tensor  # (B, H*W, D) X2^0


class ChangeDetector(nn.Module):
    """§3.1 SCORER encoder (``change_detector``); torch-default init (§3.5)."""

    def __init__(
        self,
        feat_dim: int = 1026,
        att_dim: int = 512,
        att_head: int = 8,
        num_layers: int = 2,
        grid_size: int = 14,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.config = dict(
            feat_dim=feat_dim,
            att_dim=att_dim,
            att_head=att_head,
            num_layers=num_layers,
            grid_size=grid_size,
            dropout=dropout,
        )
        self.img = nn.Sequential(nn.Conv2d(feat_dim, att_dim, kernel_size=1))
        self.w_embedding = nn.Embedding(grid_size, att_dim // 2)
        self.h_embedding = nn.Embedding(grid_size, att_dim // 2)
        self.scorer = nn.ModuleList(
            [ScorerLayer(att_dim, att_head, dropout) for _ in range(num_layers)]
        )
        self.embed_fc = nn.Sequential(
            nn.Linear(2 * att_dim, att_dim), nn.Dropout(dropout), nn.ReLU()
        )

    def forward(self, x_bef: Tensor, x_aft: Tensor) -> ChangeDetectorOutput:
        """x_bef, x_aft (B, feat_dim, H, W) channels-first -> :class:`ChangeDetectorOutput`."""
        x1_0 = embed_image(self.img, self.w_embedding, self.h_embedding, x_bef)
        x2_0 = embed_image(self.img, self.w_embedding, self.h_embedding, x_aft)
        x1, x2 = x1_0, x2_0
        sim1 = sim2 = None
        last = len(self.scorer) - 1
        for idx, layer in enumerate(self.scorer):
            # Only the last layer's S matrices are returned (S-Q3). The official code also
            # computes them for the earlier layers and throws them away; that has no effect on any
            # output or gradient, so they are skipped here (B^2 * HW^2 memory).
            keep = idx == last
            # Simultaneous update, weights shared by both directions (§3.1 step 4).
            new1, s1, _ = layer(x1, x2, keep)
            new2, s2, _ = layer(x2, x1, keep)
            x1, x2 = new1, new2
            if keep:
                sim1, sim2 = s1, s2
        memory = self.embed_fc(torch.cat([x1, x2], dim=-1))  # bef channels first (§3.1 step 5)
        return ChangeDetectorOutput(memory, sim1, sim2, x1_0, x2_0)


# ------------------------------------------------------------------------------------------------
# Decoder Speaker (§3.2)
# ------------------------------------------------------------------------------------------------


class SpeakerAttention(nn.Module):
    """§3.2 ``self_attention`` / ``dec_enc_attention``: q/k/v Linear, softmax(QK^T/sqrt(dh) +
    additive mask), dropout on the probabilities, heads merged, NO output projection (S-Q5)."""

    def __init__(self, dim: int = 512, heads: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q_in: Tensor, kv_in: Tensor, additive_mask: Tensor | None = None) -> Tensor:
        """q_in (B, Lq, D), kv_in (B, Lk, D), additive_mask (B, Lq, Lk) or None -> (B, Lq, D)."""
        q, k, v = self.query(q_in), self.key(kv_in), self.value(kv_in)
        b, lq, d = q.shape
        lk = k.shape[1]
        dh = d // self.heads
        qh = q.view(b, lq, self.heads, dh).transpose(1, 2)
        kh = k.view(b, lk, self.heads, dh).transpose(1, 2)
        vh = v.view(b, lk, self.heads, dh).transpose(1, 2)
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(dh)
        if additive_mask is not None:
            scores = scores + additive_mask.unsqueeze(1)
        probs = self.dropout(F.softmax(scores, dim=-1))
        return (probs @ vh).transpose(1, 2).reshape(b, lq, d)


class Intermediate(nn.Module):
    """§3.2 step 4 ``hidden_intermediate``: g = GELU_erf(dense(x)), 512 -> 512."""

    def __init__(self, dim: int = 512) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """(B, Lt, D) -> (B, Lt, D)."""
        return F.gelu(self.dense(x))  # exact erf form (§1.2)


class Output(nn.Module):
    """§3.2 step 4 ``output``: LayerNorm(Dropout(dense(g)) + g); the residual is the GELU
    output g itself, not the sub-layer input (S-Q4)."""

    def __init__(self, dim: int = 512, dropout: float = 0.1) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=1e-6)  # official key name output.LayerNorm
        self.dropout = nn.Dropout(dropout)

    def forward(self, g: Tensor) -> Tensor:
        """(B, Lt, D) -> (B, Lt, D)."""
        return self.LayerNorm(self.dropout(self.dense(g)) + g)


class DecoderLayer(nn.Module):
    """§3.2 ``core.layer.{l}``: post-LN self-attention, cross-attention, odd FFN."""

    def __init__(self, dim: int = 512, heads: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        # Registration order = Appendix A key order.
        self.self_attention = SpeakerAttention(dim, heads, dropout)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.dec_enc_attention = SpeakerAttention(dim, heads, dropout)
        self.hidden_intermediate = Intermediate(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.output = Output(dim, dropout)

    def forward(self, h: Tensor, memory: Tensor, self_mask: Tensor) -> Tensor:
        """h (B, Lt, D), memory (B, HW, D), additive self mask (B, Lt, Lt) -> (B, Lt, D)."""
        a1 = self.norm1(self.self_attention(h, h, self_mask) + h)
        a2 = self.norm2(a1 + self.dec_enc_attention(a1, memory))  # no mask on the memory
        return self.output(self.hidden_intermediate(a2))


def speaker_self_mask(mask: Tensor) -> Tensor:
    """§3.2 step 1: additive (1 - A) * -10000 with A[b, i, j] = mask[b, j] * [j <= i]."""
    lt = mask.shape[1]
    # A float mask keeps its dtype (float64 in the reproduce command's float64 test).
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    causal = torch.tril(torch.ones(lt, lt, dtype=dtype, device=mask.device))
    allowed = mask.to(dtype).unsqueeze(1) * causal.unsqueeze(0)
    return (1.0 - allowed) * MASK_VALUE


class SpeakerCore(nn.Module):
    """§3.2 ``core``: ``fc`` (Linear -> Dropout -> LN), ``position_enc``, ``embed``, layers."""

    def __init__(
        self,
        vocab_size: int = 76,
        word_dim: int = 300,
        att_dim: int = 512,
        att_head: int = 8,
        num_layers: int = 2,
        seq_length: int = 24,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.fc = nn.Sequential(
            nn.Linear(word_dim, att_dim), nn.Dropout(dropout), nn.LayerNorm(att_dim, eps=1e-6)
        )
        self.position_enc = PositionalEncoding(word_dim, seq_length)
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=PAD_ID)
        self.layer = nn.ModuleList(
            [DecoderLayer(att_dim, att_head, dropout) for _ in range(num_layers)]
        )

    def forward(self, memory: Tensor, seq: Tensor, mask: Tensor) -> Tensor:
        """memory (B, HW, D), seq (B, Lt) ids, mask (B, Lt) -> last layer output (B, Lt, D)."""
        h = self.fc(self.position_enc(self.embed(seq)))
        self_mask = speaker_self_mask(mask)
        for layer in self.layer:
            h = layer(h, memory, self_mask)
        return h


class Speaker(nn.Module):
    """§3.2 SCORER decoder (``speaker``): ``core`` + ``logit`` (share_wd_cls_weight=False).

    Init §3.5: every Linear/Embedding weight ~ N(0, 0.02^2) (overwriting the pad row, S-Q7),
    Linear biases 0, LayerNorm 1/0; ``pe`` is a fixed buffer.
    """

    def __init__(
        self,
        vocab_size: int = 76,
        word_dim: int = 300,
        att_dim: int = 512,
        att_head: int = 8,
        num_layers: int = 2,
        seq_length: int = 24,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.config = dict(
            vocab_size=vocab_size,
            word_dim=word_dim,
            att_dim=att_dim,
            att_head=att_head,
            num_layers=num_layers,
            seq_length=seq_length,
            dropout=dropout,
        )
        self.seq_length = seq_length
        self.core = SpeakerCore(
            vocab_size, word_dim, att_dim, att_head, num_layers, seq_length, dropout
        )
        self.logit = nn.Linear(att_dim, vocab_size)
        self.apply(_speaker_init_weights)

    def forward(self, memory: Tensor, seq: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """memory (B, HW, D), seq (B, Lt) int ids (START at 0), mask (B, Lt) float ->
        (logits (B, Lt, V), last decoder-layer output (B, Lt, D), the CBR ``sent`` input)."""
        hidden = self.core(memory, seq, mask)
        return self.logit(hidden), hidden


def _speaker_init_weights(module: nn.Module) -> None:
    # §3.5 / transformer_decoder.py init_weights.
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


# ------------------------------------------------------------------------------------------------
# CBR generator (§3.3)
# ------------------------------------------------------------------------------------------------


class ContraAttention(nn.Module):
    """§3.3 step 3 ``contra``: S = exp(logit_scale) * MTM(query(H), key(aft))."""

    def __init__(self, dim: int = 512) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.ones([]))  # §3.5: 1.0
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)

    def forward(self, hallucination: Tensor, aft: Tensor) -> Tensor:
        """(B, HW, D), (B, HW, D) -> S (B, B); rows index hallucinations, columns afters."""
        return self.logit_scale.exp() * mtm_similarity(self.query(hallucination), self.key(aft))


class CBR(nn.Module):
    """§3.3 CBR (``generator``): hallucinate the after-image from the before-features and the
    sentence, then a symmetric MTM contrastive loss against the real after-features.

    torch-default init (§3.5). Never optimised, never checkpointed (S-Q1).
    """

    def __init__(self, att_dim: int = 512, att_head: int = 8) -> None:
        super().__init__()
        self.config = dict(att_dim=att_dim, att_head=att_head)
        self.conv1 = nn.Conv2d(2 * att_dim, att_dim, kernel_size=1)
        self.mh_att = nn.MultiheadAttention(att_dim, att_head, dropout=0.0, bias=False)
        self.conv2 = nn.Sequential(nn.Conv2d(att_dim, att_dim, kernel_size=1))
        self.contra = ContraAttention(att_dim)

    def hallucinate(self, bef: Tensor, sent: Tensor, masks: Tensor) -> Tensor:
        """§3.3 steps 1-2: bef (B, HW, D), sent (B, Lt, D), masks (B, Lt) -> H (B, HW, D)."""
        b, n, d = bef.shape
        g = math.isqrt(n)
        if g * g != n:
            raise ValueError(f"CBR needs a square grid (official: 14x14), got {n} tokens")
        # S-Q8: masked sum divided by the padded length Lt, not by the caption length.
        s = (sent * masks.unsqueeze(-1).to(sent.dtype)).sum(dim=1) / sent.shape[1]
        grid = bef.transpose(1, 2).reshape(b, d, g, g)
        x = torch.cat([grid, s[:, :, None, None].expand(b, d, g, g)], dim=1)  # bef = ch 0..D-1
        x = self.conv1(x).flatten(2).permute(2, 0, 1)  # (HW, B, D), the official layout (§1.3)
        x, _ = self.mh_att(x, x, x, need_weights=False)  # no residual, no LN
        x = x.permute(1, 2, 0).reshape(b, d, g, g)
        return self.conv2(x).flatten(2).transpose(1, 2)

    def forward(self, bef: Tensor, sent: Tensor, aft: Tensor, masks: Tensor) -> Tensor:
        """§3.3: bef = X1^0, sent = last decoder-layer output, aft = X2^0, masks (B, Lt) ->
        L_cbr = 1/2 [rowCE(S) + rowCE(S^T)] (scalar)."""
        sim = self.contra(self.hallucinate(bef, sent, masks), aft)
        return 0.5 * (row_cross_entropy(sim) + row_cross_entropy(sim.t()))


# ------------------------------------------------------------------------------------------------
# Losses (§3.4) and the logit-scale clamp
# ------------------------------------------------------------------------------------------------


def scorer_pair_losses(
    change_detector: ChangeDetector,
    speaker: Speaker,
    generator: CBR,
    before: Tensor,
    after: Tensor,
    labels: Tensor,
    targets: Tensor,
    masks: Tensor,
) -> dict[str, Tensor]:
    """§3.4 for one pair: {"cap": CE, "sim": 1/2 (rowCE(S1) + rowCE(S2)), "cbr": L_cbr}.

    before/after (B, feat_dim, H, W); labels (B, Lt) decoder input ids; targets (B, Lt)
    labels_with_ignore; masks (B, Lt).
    """
    enc = change_detector(before, after)
    logits, sent = speaker(enc.memory, labels, masks)
    return {
        "cap": caption_cross_entropy(logits, targets),
        "sim": 0.5 * (row_cross_entropy(enc.sim_bef) + row_cross_entropy(enc.sim_aft)),
        "cbr": generator(enc.input_bef, sent, enc.input_aft, masks),
    }


def scorer_losses(
    change_detector: ChangeDetector,
    speaker: Speaker,
    generator: CBR,
    before: Tensor,
    after_sc: Tensor,
    after_nsc: Tensor,
    labels: Tensor,
    targets: Tensor,
    masks: Tensor,
    no_chg_labels: Tensor,
    no_chg_targets: Tensor,
    no_chg_masks: Tensor,
) -> dict[str, Tensor]:
    """§3.4, train.py:168-191. "pos" = (before, after_sc, change caption), "neg" = (before,
    after_nsc, no-change caption). Features (B, feat_dim, H, W) channels-first, AddSpatialInfo
    already applied by the caller on CLEVR-Change; captions (B, Lt) as in the module docstring.

    Returns scalar tensors: ``cap_pos, cap_neg, sim_pos, sim_neg, cbr_pos, cbr_neg``, their
    halves-means ``cap`` = 1/2 cap_pos + 1/2 cap_neg (same for ``sim``, ``cbr``) and
    ``total`` = cap + 0.1 sim + 0.001 cbr.
    """
    pos = scorer_pair_losses(
        change_detector, speaker, generator, before, after_sc, labels, targets, masks
    )
    neg = scorer_pair_losses(
        change_detector,
        speaker,
        generator,
        before,
        after_nsc,
        no_chg_labels,
        no_chg_targets,
        no_chg_masks,
    )
    out: dict[str, Tensor] = {}
    for name in ("cap", "sim", "cbr"):
        out[f"{name}_pos"] = pos[name]
        out[f"{name}_neg"] = neg[name]
        out[name] = 0.5 * pos[name] + 0.5 * neg[name]
    out["total"] = out["cap"] + SIM_WEIGHT * out["sim"] + CBR_WEIGHT * out["cbr"]
    return out


@torch.no_grad()
def clamp_logit_scales(change_detector: ChangeDetector, generator: CBR | None = None) -> None:
    """§3.4 / S-Q3: after each optimiser step clamp the LAST scorer layer's ``logit_scale`` (and
    ``generator.contra.logit_scale``) to <= ln 100; ``scorer.0``'s scale is left alone.

    Ambiguity: §3.4 gives only the upper bound, so no lower bound is applied (CLIP-style code
    often clamps to [0, ln 100]; the two agree while the scale stays >= 0).
    """
    change_detector.scorer[-1].attention.logit_scale.clamp_(max=LOGIT_SCALE_MAX)
    if generator is not None:
        generator.contra.logit_scale.clamp_(max=LOGIT_SCALE_MAX)


# ------------------------------------------------------------------------------------------------
# Decoding (§3.7), shared with DIRL (§4.6)
# ------------------------------------------------------------------------------------------------


class SampleOutput(NamedTuple):
    """§3.7 / §4.6 decoding result."""

    ids: Tensor  # (B, max_len) int64: START at 0, then <= max_len - 1 words; END written as 0
    log_probs: Tensor  # (B, max_len): log p of the symbol chosen at step k stored at k + 1 while
    #                    the row was unfinished (END's included), 0 at position 0 and after END


@torch.no_grad()
def sample_loop(
    logits_fn: Callable[[Tensor, Tensor], Tensor],
    batch_size: int,
    max_len: int,
    device: torch.device | str = "cpu",
    sample_max: bool = True,
    generator: torch.Generator | None = None,
) -> SampleOutput:
    """§3.7 ``Speaker.sample`` loop; ``logits_fn(ids (B, L), mask (B, L)) -> (B, L, V)`` runs the
    WHOLE decoder on all positions each step (full recompute).

    Step k: write the current symbol at k, set mask[:, k] = 1, log-softmax, set UNK to -1e10
    (after the log-softmax, no renormalisation), pick from position k (argmax if ``sample_max``
    else multinomial), unfinished &= symbol != END, symbol *= unfinished; stop early when all
    rows are finished. The prediction of the last step is discarded.
    Note: the official default is sample_max=0 (sampling); test.py decodes greedily.
    """
    ids = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
    mask = torch.zeros(batch_size, max_len, dtype=torch.float32, device=device)
    log_probs = torch.zeros(batch_size, max_len, dtype=torch.float32, device=device)
    symbol = torch.full((batch_size,), START_ID, dtype=torch.long, device=device)
    unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)
    for k in range(max_len):
        ids[:, k] = symbol
        mask[:, k] = 1.0
        logp = F.log_softmax(logits_fn(ids, mask).float(), dim=-1)
        logp[:, :, UNK_ID] = UNK_LOG_PROB
        step = logp[:, k]
        if sample_max:
            nxt = step.argmax(dim=-1)
        else:
            nxt = torch.multinomial(step.exp(), 1, generator=generator).squeeze(1)
        if k + 1 < max_len:
            chosen = step.gather(1, nxt[:, None]).squeeze(1)
            log_probs[:, k + 1] = torch.where(unfinished, chosen, torch.zeros_like(chosen))
        unfinished = unfinished & (nxt != END_ID)
        symbol = nxt * unfinished.long()
        if not bool(unfinished.any()):
            break
    return SampleOutput(ids, log_probs)


def sample(
    speaker: Speaker,
    memory: Tensor,
    sample_max: bool = True,
    max_len: int | None = None,
    generator: torch.Generator | None = None,
) -> SampleOutput:
    """§3.7 ``Speaker.sample``: memory (B, HW, D) from :class:`ChangeDetector` -> ids (B, max_len)
    (default max_len = seq_length = 24). Runs in the module's current mode: call ``.eval()`` first
    for test-time greedy decoding, as test.py does."""
    return sample_loop(
        lambda ids, mask: speaker(memory, ids, mask)[0],
        memory.shape[0],
        max_len or speaker.seq_length,
        memory.device,
        sample_max,
        generator,
    )
