"""DIRL + CCR (tuyunbin/DIRL) re-implemented in plain PyTorch: the project's torch reference,
used by the parity tests and by ``python -m benchmarks.vs_pytorch --torch``.

Written from the notes in ``docs/official/`` (cited as §N below), not from any code:
§4.1 encoder ``DIRL``, §4.2 decoder ``CCR`` in both variants, §4.3 losses, §4.4 initialisation,
§4.6 decoding and the "R" quirks of §4.8. Module and attribute names are chosen so that
``state_dict()`` keys, order and shapes equal Appendix B (and the listed CLEVR-DC differences).

Variants (§4 table):
  * ``"clevr_change"`` = ``models/CCR_no_init.py``: ``fc`` = Linear -> Dropout, ``embed_fc`` =
    Linear -> Dropout -> ReLU; torch-default init (embedding N(0, 1), pad row 0 kept zero);
    vocabulary 76, seq_length 24; encoder input 1026 channels.
  * ``"clevr_dc"`` = ``models/CCR.py``: a LayerNorm after each of those Linears; xavier_uniform on
    every >= 2-D decoder parameter (pad row overwritten); vocabulary 87, seq_length 40; encoder
    input 1024 channels (no AddSpatialInfo).

Layouts: features channels-first (B, C, H, W), H = W; tokens batch-first (B, H*W, D), t = W*i + j;
``nn.MultiheadAttention`` is used with the official (L, B, D) layout internally (§1.3); captions
(B, Lt) int64 ids / float masks / int64 targets with -1 (as in :mod:`.scorer`). float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .scorer import (
    PositionalEncoding,
    SampleOutput,
    caption_cross_entropy,
    embed_image,
    row_cross_entropy,
    sample_loop,
)

VARIANTS = ("clevr_change", "clevr_dc")
# variant -> (vocab_size, seq_length, encoder feat_dim) of the shipped configs (§4 table).
VARIANT_DEFAULTS = {"clevr_change": (76, 24, 1026), "clevr_dc": (87, 40, 1024)}
# variant -> (dirl weight, ccr weight) (§4.3).
LOSS_WEIGHTS = {"clevr_change": (0.5, 0.3), "clevr_dc": (0.03, 0.05)}
OFF_DIAGONAL_WEIGHT = 0.003  # §4.1 step 2, alpha (D-Q3)
LAYER_NORM_EPS = 1e-5  # torch default, all DIRL/CCR LayerNorms (§7 item 2)


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _xavier_matrices(module: nn.Module) -> None:
    # §4.4: xavier_uniform on every parameter with >= 2 dims; biases / LN keep their init.
    for param in module.parameters():
        if param.dim() > 1:
            nn.init.xavier_uniform_(param)


def barlow_loss(y1: Tensor, y2: Tensor, off_diagonal_weight: float = OFF_DIAGONAL_WEIGHT) -> Tensor:
    """§4.1 step 2 (D-Q3): y1, y2 (N, D) with N = B*HW rows (b, t). Each channel z-scored over
    the N rows with the Bessel-corrected std; C = Z1^T Z2 / N;
    L = sum_i (C_ii - 1)^2 + alpha * sum_{i != j} C_ij^2 (scalar)."""
    n = y1.shape[0]
    z1 = (y1 - y1.mean(dim=0)) / y1.std(dim=0)  # torch std: unbiased (N - 1)
    z2 = (y2 - y2.mean(dim=0)) / y2.std(dim=0)
    c = z1.t() @ z2 / n
    diag = torch.diagonal(c)
    on_diag = (diag - 1.0).pow(2).sum()
    off_diag = c.pow(2).sum() - diag.pow(2).sum()
    return on_diag + off_diagonal_weight * off_diag


def ccr_loss(t: Tensor, v: Tensor) -> Tensor:
    """§4.2 step 3 (D-Q6): S = t v^T (B, B) raw dot products; logits = (S/0.5 + S^T/0.5) / 2
    = S + S^T; one row cross-entropy with diagonal targets (scalar)."""
    s = t @ v.t()
    logits = ((s / 0.5) + (s.t() / 0.5)) / 2
    return row_cross_entropy(logits)


# ------------------------------------------------------------------------------------------------
# Encoder DIRL (§4.1)
# ------------------------------------------------------------------------------------------------


class DIRLCrossLayer(nn.Module):
    """§4.1 step 3 ``transformer.{l}``: T(x, y) = LN1(x + Dropout(MHA(q=x, k=v=y))), no FFN."""

    def __init__(self, dim: int = 512, heads: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """x (Lx, B, D), y (Ly, B, D) in the (L, B, D) layout -> (Lx, B, D)."""
        attended, _ = self.attention(x, y, y, need_weights=False)
        return self.norm1(x + self.dropout(attended))


class DIRLOutput(NamedTuple):
    """§4.1 step 4 outputs (+ the pre-layer tokens X^0)."""

    diff_bef: Tensor  # (B, HW, D) X1^0 - X1^L (pre minus post)
    diff_aft: Tensor  # (B, HW, D) X2^0 - X2^L
    dirl_loss: Tensor  # scalar, §4.1 step 2
    input_bef: Tensor  # (B, HW, D) X1^0
    input_aft: Tensor  # (B, HW, D) X2^0


class DIRL(nn.Module):
    """§4.1 DIRL encoder (``change_detector``); xavier init on >= 2-D params (§4.4).

    ``feat_dim`` 1026 (CLEVR-Change, with AddSpatialInfo) or 1024 (CLEVR-DC).
    """

    def __init__(
        self,
        feat_dim: int = 1026,
        att_dim: int = 512,
        att_head: int = 8,
        num_layers: int = 2,
        mlp_dim: int = 2048,
        grid_size: int = 14,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.config = dict(
            feat_dim=feat_dim,
            att_dim=att_dim,
            att_head=att_head,
            num_layers=num_layers,
            mlp_dim=mlp_dim,
            grid_size=grid_size,
            dropout=dropout,
        )
        self.img = nn.Sequential(nn.Conv2d(feat_dim, att_dim, kernel_size=1))
        self.w_embedding = nn.Embedding(grid_size, att_dim // 2)
        self.h_embedding = nn.Embedding(grid_size, att_dim // 2)
        self.mlp = nn.Sequential(
            nn.Linear(att_dim, mlp_dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(mlp_dim, att_dim)
        )
        self.transformer = nn.ModuleList(
            [DIRLCrossLayer(att_dim, att_head, dropout) for _ in range(num_layers)]
        )
        _xavier_matrices(self)

    def forward(self, x_bef: Tensor, x_aft: Tensor) -> DIRLOutput:
        """x_bef, x_aft (B, feat_dim, H, W) channels-first -> :class:`DIRLOutput`."""
        x1_0 = embed_image(self.img, self.w_embedding, self.h_embedding, x_bef)
        x2_0 = embed_image(self.img, self.w_embedding, self.h_embedding, x_aft)
        d = x1_0.shape[-1]
        # DIRL loss on the shared MLP head (dropout active in training); rows ordered (b, t).
        loss = barlow_loss(self.mlp(x1_0.reshape(-1, d)), self.mlp(x2_0.reshape(-1, d)))
        x1, x2 = x1_0.transpose(0, 1), x2_0.transpose(0, 1)  # (HW, B, D)
        for layer in self.transformer:
            x1, x2 = layer(x1, x2), layer(x2, x1)  # simultaneous update, shared layer (D-Q4)
        x1, x2 = x1.transpose(0, 1), x2.transpose(0, 1)
        return DIRLOutput(x1_0 - x1, x2_0 - x2, loss, x1_0, x2_0)


# ------------------------------------------------------------------------------------------------
# Decoder CCR (§4.2)
# ------------------------------------------------------------------------------------------------


class CrossTransformer(nn.Module):
    """§4.2 step 3 ``core.layer.{l}``: post-LN masked self-attention, cross-attention, FFN ReLU.

    Also returns the CCR vectors t / v = means over ALL Lt positions (pads included, D-Q5) of the
    self- and cross-attention sub-layer outputs.
    """

    def __init__(
        self, dim: int = 512, heads: int = 8, ffn_dim: int = 2048, dropout: float = 0.1
    ) -> None:
        super().__init__()
        # Registration order = Appendix B key order (dropouts have no parameters).
        self.self_att = nn.MultiheadAttention(dim, heads, dropout=dropout)
        self.cross_att = nn.MultiheadAttention(dim, heads, dropout=dropout)
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.norm3 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.linear1 = nn.Linear(dim, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, dim)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.dropout4 = nn.Dropout(dropout)

    def forward(
        self, tgt: Tensor, memory: Tensor, attn_mask: Tensor, key_padding_mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """tgt (Lt, B, D), memory (HW, B, D), attn_mask (Lt, Lt) bool True = blocked (causal),
        key_padding_mask (B, Lt) bool True = pad -> (out (Lt, B, D), t (B, D), v (B, D))."""
        # The official causal mask is float -inf above the diagonal; a bool mask gives the same
        # -inf scores (and avoids torch's mixed-mask-type deprecation warning).
        sa, _ = self.self_att(
            tgt,
            tgt,
            tgt,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            need_weights=False,
        )
        o1 = self.norm1(tgt + self.dropout1(sa))
        t = o1.mean(dim=0)  # over the Lt axis of the (Lt, B, D) layout (§1.3)
        ca, _ = self.cross_att(o1, memory, memory, need_weights=False)  # no mask
        o2 = self.norm2(o1 + self.dropout2(ca))
        v = o2.mean(dim=0)
        ffn = self.linear2(self.dropout3(torch.relu(self.linear1(o2))))
        return self.norm3(o2 + self.dropout4(ffn)), t, v


class CCRCore(nn.Module):
    """§4.2 ``core``: ``embed``, ``fc``, ``embed_fc``, ``position_enc``, ``layer``."""

    def __init__(
        self,
        variant: str,
        vocab_size: int,
        seq_length: int,
        word_dim: int = 300,
        att_dim: int = 512,
        att_head: int = 8,
        num_layers: int = 2,
        ffn_dim: int = 2048,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        _check_variant(variant)
        dc = variant == "clevr_dc"
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        fc: list[nn.Module] = [nn.Linear(word_dim, att_dim)]
        embed_fc: list[nn.Module] = [nn.Linear(2 * att_dim, att_dim)]
        if dc:
            # CCR.py: LayerNorm right after the Linear (eps = torch default 1e-5, §7 item 2).
            fc.append(nn.LayerNorm(att_dim, eps=LAYER_NORM_EPS))
            embed_fc.append(nn.LayerNorm(att_dim, eps=LAYER_NORM_EPS))
        self.fc = nn.Sequential(*fc, nn.Dropout(dropout))
        self.embed_fc = nn.Sequential(*embed_fc, nn.Dropout(dropout), nn.ReLU())
        self.position_enc = PositionalEncoding(word_dim, seq_length)
        self.layer = nn.ModuleList(
            [CrossTransformer(att_dim, att_head, ffn_dim, dropout) for _ in range(num_layers)]
        )

    def memory(self, diff_bef: Tensor, diff_aft: Tensor) -> Tensor:
        """§4.2 step 1: embed_fc(cat(diff_bef, diff_aft)), (B, HW, 2D) -> (B, HW, D)."""
        return self.embed_fc(torch.cat([diff_bef, diff_aft], dim=-1))

    def forward(self, memory: Tensor, seq: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """memory (B, HW, D), seq (B, Lt), mask (B, Lt) -> (hidden (B, Lt, D), t, v) of the last
        layer (only its CCR vectors are used, D-Q6)."""
        lt = seq.shape[1]
        h = self.fc(self.position_enc(self.embed(seq))).transpose(0, 1)  # (Lt, B, D)
        mem = memory.transpose(0, 1)  # (HW, B, D)
        causal = torch.ones(lt, lt, dtype=torch.bool, device=seq.device).triu(diagonal=1)
        pad = mask == 0
        t = v = None
        for layer in self.layer:
            h, t, v = layer(h, mem, causal, pad)
        return h.transpose(0, 1), t, v


class CCROutput(NamedTuple):
    """§4.2 decoder outputs."""

    logits: Tensor  # (B, Lt, V)
    ccr_loss: Tensor  # scalar, last layer (§4.2 step 3)
    t: Tensor  # (B, D) mean over Lt of the last layer's self-attention sub-layer output
    v: Tensor  # (B, D) mean over Lt of the last layer's cross-attention sub-layer output
    hidden: Tensor  # (B, Lt, D) last decoder-layer output


class CCRSpeaker(nn.Module):
    """§4.2 CCR decoder (``speaker``): ``core`` + ``logit``; ``variant`` picks CCR_no_init
    (``"clevr_change"``) or CCR (``"clevr_dc"``). ``vocab_size`` / ``seq_length`` default to the
    variant's shipped config (76/24 or 87/40)."""

    def __init__(
        self,
        variant: str = "clevr_change",
        vocab_size: int | None = None,
        seq_length: int | None = None,
        word_dim: int = 300,
        att_dim: int = 512,
        att_head: int = 8,
        num_layers: int = 2,
        ffn_dim: int = 2048,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        _check_variant(variant)
        default_vocab, default_len, _ = VARIANT_DEFAULTS[variant]
        vocab_size = vocab_size or default_vocab
        seq_length = seq_length or default_len
        self.variant = variant
        self.seq_length = seq_length
        self.config = dict(
            variant=variant,
            vocab_size=vocab_size,
            seq_length=seq_length,
            word_dim=word_dim,
            att_dim=att_dim,
            att_head=att_head,
            num_layers=num_layers,
            ffn_dim=ffn_dim,
            dropout=dropout,
        )
        self.core = CCRCore(
            variant,
            vocab_size,
            seq_length,
            word_dim,
            att_dim,
            att_head,
            num_layers,
            ffn_dim,
            dropout,
        )
        self.logit = nn.Linear(att_dim, vocab_size)
        if variant == "clevr_dc":
            # §4.4 CCR.py: xavier on every >= 2-D decoder param (embed, fc.0, embed_fc.0, in/out
            # projections, linear1/2, logit); the embedding's pad row is overwritten. The buffer
            # ``pe`` is not a parameter and stays the sinusoid.
            _xavier_matrices(self)
        # clevr_change (CCR_no_init.py): torch defaults, embedding N(0, 1) with row 0 = 0.

    def memory(self, diff_bef: Tensor, diff_aft: Tensor) -> Tensor:
        """See :meth:`CCRCore.memory`."""
        return self.core.memory(diff_bef, diff_aft)

    def decode(self, memory: Tensor, seq: Tensor, mask: Tensor) -> CCROutput:
        """memory (B, HW, D) from :meth:`memory`, seq (B, Lt), mask (B, Lt) -> CCROutput."""
        hidden, t, v = self.core(memory, seq, mask)
        return CCROutput(self.logit(hidden), ccr_loss(t, v), t, v, hidden)

    def forward(self, diff_bef: Tensor, diff_aft: Tensor, seq: Tensor, mask: Tensor) -> CCROutput:
        """diff_bef, diff_aft (B, HW, D) from :class:`DIRL`; seq (B, Lt) ids (START at 0);
        mask (B, Lt) float -> :class:`CCROutput`."""
        return self.decode(self.memory(diff_bef, diff_aft), seq, mask)


def build_dirl(variant: str = "clevr_change", **overrides: int | float) -> tuple[DIRL, CCRSpeaker]:
    """Encoder then decoder (the official creation order, §4.4) with the variant's default sizes;
    ``overrides`` may set ``feat_dim``, ``att_dim``, ``att_head``, ``num_layers``, ``mlp_dim``,
    ``grid_size``, ``vocab_size``, ``seq_length``, ``word_dim``, ``ffn_dim``, ``dropout``."""
    _check_variant(variant)
    vocab, seq_len, feat_dim = VARIANT_DEFAULTS[variant]
    get = overrides.get
    common = dict(
        att_dim=get("att_dim", 512),
        att_head=get("att_head", 8),
        num_layers=get("num_layers", 2),
        dropout=get("dropout", 0.1),
    )
    unknown = set(overrides) - {
        "feat_dim",
        "mlp_dim",
        "grid_size",
        "vocab_size",
        "seq_length",
        "word_dim",
        "ffn_dim",
        *common,
    }
    if unknown:
        raise TypeError(f"unknown size overrides {sorted(unknown)}")
    encoder = DIRL(
        feat_dim=get("feat_dim", feat_dim),
        mlp_dim=get("mlp_dim", 2048),
        grid_size=get("grid_size", 14),
        **common,
    )
    decoder = CCRSpeaker(
        variant,
        vocab_size=get("vocab_size", vocab),
        seq_length=get("seq_length", seq_len),
        word_dim=get("word_dim", 300),
        ffn_dim=get("ffn_dim", 2048),
        **common,
    )
    return encoder, decoder


# ------------------------------------------------------------------------------------------------
# Losses (§4.3)
# ------------------------------------------------------------------------------------------------


def dirl_pair_losses(
    encoder: DIRL,
    speaker: CCRSpeaker,
    before: Tensor,
    after: Tensor,
    labels: Tensor,
    targets: Tensor,
    masks: Tensor,
) -> dict[str, Tensor]:
    """One pair: {"cap": caption CE, "dirl": L_dirl, "ccr": L_ccr} (scalars)."""
    enc = encoder(before, after)
    out = speaker(enc.diff_bef, enc.diff_aft, labels, masks)
    return {
        "cap": caption_cross_entropy(out.logits, targets),
        "dirl": enc.dirl_loss,
        "ccr": out.ccr_loss,
    }


def dirl_losses(
    encoder: DIRL,
    speaker: CCRSpeaker,
    before: Tensor,
    after_sc: Tensor,
    labels: Tensor,
    targets: Tensor,
    masks: Tensor,
    after_nsc: Tensor | None = None,
    no_chg_labels: Tensor | None = None,
    no_chg_targets: Tensor | None = None,
    no_chg_masks: Tensor | None = None,
    variant: str | None = None,
) -> dict[str, Tensor]:
    """§4.3. Features (B, feat_dim, H, W) channels-first; captions (B, Lt) ids / targets (-1 =
    ignore) / float masks. ``variant`` defaults to ``speaker.variant``.

    clevr_change (train_clevr_change.py:162-181): needs the distractor pair too; returns
    ``cap_pos, cap_neg, dirl_pos, dirl_neg, ccr_pos, ccr_neg``, the means ``cap`` = 1/2 cap_pos +
    1/2 cap_neg (same for ``dirl``, ``ccr``) and ``total`` = cap + 0.5 dirl + 0.3 ccr.
    clevr_dc (train.py:156-171): one pair; returns ``cap, dirl, ccr`` and
    ``total`` = cap + 0.03 dirl + 0.05 ccr.
    """
    variant = variant or speaker.variant
    _check_variant(variant)
    w_dirl, w_ccr = LOSS_WEIGHTS[variant]
    pos = dirl_pair_losses(encoder, speaker, before, after_sc, labels, targets, masks)
    out: dict[str, Tensor] = {}
    if variant == "clevr_dc":
        out.update(pos)
    else:
        if after_nsc is None or no_chg_labels is None or no_chg_targets is None:
            raise ValueError("clevr_change needs after_nsc, no_chg_labels and no_chg_targets")
        if no_chg_masks is None:
            raise ValueError("clevr_change needs no_chg_masks")
        neg = dirl_pair_losses(
            encoder, speaker, before, after_nsc, no_chg_labels, no_chg_targets, no_chg_masks
        )
        for name in ("cap", "dirl", "ccr"):
            out[f"{name}_pos"] = pos[name]
            out[f"{name}_neg"] = neg[name]
            out[name] = 0.5 * pos[name] + 0.5 * neg[name]
    out["total"] = out["cap"] + w_dirl * out["dirl"] + w_ccr * out["ccr"]
    return out


# ------------------------------------------------------------------------------------------------
# Decoding (§4.6)
# ------------------------------------------------------------------------------------------------


def sample(
    speaker: CCRSpeaker,
    diff_bef: Tensor,
    diff_aft: Tensor,
    sample_max: bool = True,
    max_len: int | None = None,
    generator: torch.Generator | None = None,
) -> SampleOutput:
    """§4.6 ``CCR.sample`` = §3.7: diff_bef/diff_aft (B, HW, D) -> ids (B, max_len) with
    max_len = seq_length by default (24 CC / 40 DC); full recompute each step, key padding =
    positions not yet written. Runs in the module's current mode (``.eval()`` for greedy tests).
    The memory is computed once; with dropout off this equals recomputing it every step."""
    memory = speaker.memory(diff_bef, diff_aft)
    return sample_loop(
        lambda ids, mask: speaker.decode(memory, ids, mask).logits,
        memory.shape[0],
        max_len or speaker.seq_length,
        memory.device,
        sample_max,
        generator,
    )
