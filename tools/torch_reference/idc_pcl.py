"""IDC-PCL (yaolinli/IDC, ``clver/``) re-implemented in plain PyTorch, test-only.

Written from the notes in ``docs/official/`` (cited as §N below), not from any code:
§5.2 model (both stages), §5.3 pretraining losses, §5.4 fine-tuning losses, §5.5 greedy
decoding (as a full recompute, which §5.5 states is equal to the official cached loop) and the
"R" quirks of §5.9. Module and attribute names are chosen so that ``state_dict()`` keys, order
and shapes equal Appendix C (pretrain) and the fine-tune differences listed after it.

Layouts: image features (B, N, C) tokens (N = 49 grid cells row-major, C = 2048 on CLEVR);
captions (B, L) int64 ids, labels (B, L) int64 with -1 = no loss. float32, batch-first.
Positions of the cross-modal sequence (N = 49): CLS1 0, img1 1..N, CLS2 N+1, img2 N+2..2N+1,
then [CLS3 2N+2 (pretrain only)], then the text.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STAGES = ("pretrain", "finetune")
BOS_ID = 1  # hard-coded in modules_finetune.py (§5.1, I-Q8)
MASK_ID = 5
# Type ids of PositionalEmb (§5.2).
TYPE_CLS1, TYPE_IMG1, TYPE_CLS2, TYPE_IMG2, TYPE_CLS3, TYPE_TEXT = 1, 2, 3, 4, 5, 6
NEG_INF = -1e9  # masked_fill value of the official attention


def sinusoid_table(length: int, dim: int) -> Tensor:
    """§5.2 / I-Q2: the NON-standard sinusoid, evaluated in Python double precision and stored
    as float32: pe[p, i] = sin(p / 10000^(2i/d)), pe[p, i+1] = cos(p / 10000^(2(i+1)/d))."""
    rows = []
    for pos in range(length):
        row = [0.0] * dim
        for i in range(0, dim, 2):
            row[i] = math.sin(pos / (10000 ** ((2 * i) / dim)))
            if i + 1 < dim:
                row[i + 1] = math.cos(pos / (10000 ** ((2 * (i + 1)) / dim)))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


class LayerNorm(nn.Module):
    """§5.2 / I-Q1: a_2 * (x - mean) / (std + eps) + b_2, std unbiased, eps added to the std."""

    def __init__(self, features: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)  # unbiased (N - 1)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class PositionalEmb(nn.Module):
    """§5.2 PositionalEmb: type embedding + (mode-dependent) sinusoid, LN(1e-12), dropout."""

    def __init__(self, d_model: int, dropout: float, n_types: int = 7, max_len: int = 200) -> None:
        super().__init__()
        self.d_model = d_model
        # Buffer registered before the children: state_dict lists `pe` first (Appendix C).
        self.register_buffer("pe", sinusoid_table(max_len, d_model).unsqueeze(0))
        self.type_pe = nn.Embedding(n_types, d_model)
        self.layernorm = LayerNorm(d_model, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, type_id: int, mode: str) -> Tensor:
        type_emb = self.type_pe(torch.full(x.shape[:2], type_id, dtype=torch.long))
        if mode == "img":
            x = x + type_emb + self.pe[:, : x.size(1)]
        elif mode == "text":
            x = x * math.sqrt(self.d_model) + type_emb + self.pe[:, : x.size(1)]
        elif mode == "cls":
            x = x + type_emb  # no sinusoid for the CLS tokens
        else:
            raise ValueError(mode)
        return self.dropout(self.layernorm(x))

    def text_at(self, x: Tensor, positions: Tensor) -> Tensor:
        """Text mode with explicit sinusoid rows (the teacher-forced decoding layout)."""
        type_emb = self.type_pe(torch.full(x.shape[:2], TYPE_TEXT, dtype=torch.long))
        x = x * math.sqrt(self.d_model) + type_emb + self.pe[0, positions][None]
        return self.dropout(self.layernorm(x))


class MultiHeadAttention(nn.Module):
    """§5.2: q/v/k/out Linears (in that registration order), scores QK^T / sqrt(d_k),
    masked_fill(mask == 0, -1e9), softmax, dropout, merge heads, out."""

    def __init__(self, n_head: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.d_k = d_model // n_head
        self.h = n_head
        self.q_linear = nn.Linear(d_model, d_model)
        self.v_linear = nn.Linear(d_model, d_model)
        self.k_linear = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, d_model)
        self.last_probs: Tensor | None = None  # kept for the attention-map tests

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        b = q.size(0)
        q = self.q_linear(q).view(b, -1, self.h, self.d_k).transpose(1, 2)
        k = self.k_linear(k).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.v_linear(v).view(b, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1) == 0, NEG_INF)  # mask (B, Lq, Lk)
        probs = F.softmax(scores, dim=-1)
        self.last_probs = probs.detach()
        ctx = torch.matmul(self.dropout(probs), v)
        ctx = ctx.transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.out(ctx)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.dropout(F.relu(self.w_1(x))))


class SublayerConnection(nn.Module):
    """Pre-LN residual: x + dropout(sublayer(norm(x)))."""

    def __init__(self, size: int, dropout: float) -> None:
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, sublayer) -> Tensor:
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(n_head, d_model, dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.sublayer = nn.ModuleList([SublayerConnection(d_model, dropout) for _ in range(2)])

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = self.sublayer[0](x, lambda y: self.attn(y, y, y, mask))
        return self.sublayer[1](x, self.feed_forward)


class Transformer(nn.Module):
    """§5.2 / I-Q3: LN at the INPUT, then n pre-LN blocks, no final LN."""

    def __init__(self, d_model: int, n_head: int, d_ff: int, n_block: int, dropout: float) -> None:
        super().__init__()
        self.norm = LayerNorm(d_model)  # registered before `layers` (Appendix C order)
        self.layers = nn.ModuleList(
            [EncoderLayer(d_model, n_head, d_ff, dropout) for _ in range(n_block)]
        )

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x, mask)
        return x


class FeatRegress(nn.Module):
    """§5.2 / I-Q4: Linear -> GELU(erf) -> LN(1e-12), then y W_imgproj + bias, with W the
    img_project.0 weight (d, C) shared as a Parameter (so it appears twice in state_dict)."""

    def __init__(self, d_model: int, img_weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = img_weight  # tied: the same Parameter object
        self.bias = nn.Parameter(torch.zeros(img_weight.size(1)))
        self.net = nn.Sequential(
            nn.Linear(d_model, d_model), nn.GELU(), LayerNorm(d_model, eps=1e-12)
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.net(x), self.weight.t(), self.bias)


class PretrainOutput(NamedTuple):
    hidden: Tensor  # (B, 2N+2+1+L, D)
    mlm_logits: Tensor  # (B, L, V) at the text positions
    regressed: Tensor  # (B, 2N, C) feat_regress of the image-token outputs (img1 then img2)
    visual: Tensor  # (B, D) (out[:, CLS1] + out[:, CLS2]) / 2, not normalised
    text_cls: Tensor  # (B, D) out[:, CLS3]


class FinetuneOutput(NamedTuple):
    hidden: Tensor  # (B, 2N+2+L, D)
    mlm_logits: Tensor  # (B, L, V)
    distractor_logits: Tensor  # (B, 2)


class IDCPCL(nn.Module):
    """§5.2 model; ``stage`` picks the pretrain (feat_regress, pooler 3D->2) or fine-tune
    (pooler 2D->2, no feat_regress) heads."""

    def __init__(
        self,
        vocab_size: int,
        cls_id: int,
        stage: str = "pretrain",
        n_embs: int = 512,
        img_embs: int = 2048,
        dim_ff: int = 2048,
        n_head: int = 8,
        n_block: int = 3,
        dropout: float = 0.2,
        pe_len: int = 200,
    ) -> None:
        super().__init__()
        if stage not in STAGES:
            raise ValueError(stage)
        self.stage, self.cls_id, self.d = stage, cls_id, n_embs
        self.word_embedding = nn.Embedding(vocab_size, n_embs)
        self.img_project = nn.Sequential(nn.Linear(img_embs, n_embs), nn.Sigmoid())
        self.position_encoding = PositionalEmb(n_embs, dropout, 7, pe_len)
        self.single_img_encoder = Transformer(n_embs, n_head, dim_ff, 1, dropout)
        self.double_img_encoder = Transformer(n_embs, n_head, dim_ff, 1, dropout)
        self.encoder = Transformer(n_embs, n_head, dim_ff, n_block, dropout)
        self.output_layer = nn.Linear(n_embs, vocab_size)
        pooled = 3 if stage == "pretrain" else 2
        self.pooler = nn.Sequential(nn.Linear(pooled * n_embs, 2))
        if stage == "pretrain":
            self.feat_regress = FeatRegress(n_embs, self.img_project[0].weight)

    # ---- embeddings (§5.2) ---------------------------------------------------------------

    def cls_token(self, batch: int, type_id: int) -> Tensor:
        ids = torch.full((batch, 1), self.cls_id, dtype=torch.long)
        return self.position_encoding(self.word_embedding(ids), type_id, "cls")

    def image_tokens(self, img1: Tensor, img2: Tensor) -> Tensor:
        """I = double_img_encoder([S1; S2]) (B, 2N+2, D)."""
        b = img1.size(0)
        e1 = self.position_encoding(self.img_project(img1), TYPE_IMG1, "img")
        e2 = self.position_encoding(self.img_project(img2), TYPE_IMG2, "img")
        s1 = self.single_img_encoder(torch.cat([self.cls_token(b, TYPE_CLS1), e1], 1))
        s2 = self.single_img_encoder(torch.cat([self.cls_token(b, TYPE_CLS2), e2], 1))
        return self.double_img_encoder(torch.cat([s1, s2], 1))

    def text_tokens(self, ids: Tensor) -> Tensor:
        return self.position_encoding(self.word_embedding(ids), TYPE_TEXT, "text")

    # ---- pretraining (§5.2, §5.3) --------------------------------------------------------

    def pretrain_forward(self, img1: Tensor, img2: Tensor, ids: Tensor) -> PretrainOutput:
        image = self.image_tokens(img1, img2)
        n_img = image.size(1)
        x = torch.cat([image, self.cls_token(ids.size(0), TYPE_CLS3), self.text_tokens(ids)], 1)
        out = self.encoder(x)  # no mask at all (§5.2, paper-vs-code item 4)
        n = (n_img - 2) // 2
        img_out = torch.cat([out[:, 1 : 1 + n], out[:, n + 2 : 2 * n + 2]], 1)
        return PretrainOutput(
            hidden=out,
            mlm_logits=self.output_layer(out[:, n_img + 1 :]),
            regressed=self.feat_regress(img_out),
            visual=(out[:, 0] + out[:, n + 1]) / 2,
            text_cls=out[:, n_img],
        )

    # ---- fine-tuning (§5.2, §5.4) --------------------------------------------------------

    @staticmethod
    def finetune_mask(batch: int, n_img: int, n_text: int) -> Tensor:
        """(B, Lq, Lk), 1 = attend: all queries see the image/CLS block, image queries see no
        text, text is causal (self included)."""
        total = n_img + n_text
        mask = torch.zeros(total, total)
        mask[:, :n_img] = 1
        mask[n_img:, n_img:] = torch.tril(torch.ones(n_text, n_text))
        return mask.unsqueeze(0).expand(batch, total, total)

    def finetune_forward(self, img1: Tensor, img2: Tensor, ids: Tensor) -> FinetuneOutput:
        image = self.image_tokens(img1, img2)
        n_img, n_text = image.size(1), ids.size(1)
        x = torch.cat([image, self.text_tokens(ids)], 1)
        out = self.encoder(x, self.finetune_mask(ids.size(0), n_img, n_text))
        n = (n_img - 2) // 2
        pooled = torch.cat([out[:, 0], out[:, n + 1]], -1)
        return FinetuneOutput(out, self.output_layer(out[:, n_img:]), self.pooler(pooled))

    @torch.no_grad()
    def greedy(self, img1: Tensor, img2: Tensor, max_len: int = 40) -> Tensor:
        """§5.5 as a full recompute: gen = [BOS]; for i in 1..max_len-1 feed gen + [MASK] with
        the fine-tuning mask and append the argmax at the MASK. No UNK ban, no early stop."""
        gen = torch.full((img1.size(0), 1), BOS_ID, dtype=torch.long)
        for _ in range(1, max_len):
            mask_tok = torch.full((img1.size(0), 1), MASK_ID, dtype=torch.long)
            logits = self.finetune_forward(img1, img2, torch.cat([gen, mask_tok], 1)).mlm_logits
            gen = torch.cat([gen, logits[:, -1].argmax(-1, keepdim=True)], 1)
        return gen


# ---- losses ---------------------------------------------------------------------------------


def mlm_token_losses(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token CE at positions with label != -1 (flattened in row-major order)."""
    keep = labels != -1
    return F.cross_entropy(logits[keep], labels[keep], reduction="none")


def pretrain_mlm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """§5.3 MLM: mean over all masked tokens of the batch."""
    return mlm_token_losses(logits, labels).mean()


def mvcl_loss(regressed: Tensor, img_mask: Tensor, img_label: Tensor) -> Tensor:
    """§5.3 MVCL (mfm_nce): p = normalize(pred at masked), y = normalize(true at masked),
    n = normalize(pred at unmasked); logits [p y^T | p n^T] in fp32 / 1.0; CE to the row index,
    mean over masked regions."""
    p = F.normalize(regressed[img_mask], dim=-1)
    y = F.normalize(img_label[img_mask], dim=-1)
    neg = F.normalize(regressed[~img_mask], dim=-1)
    logits = torch.cat([p @ y.t(), p @ neg.t()], 1).float() / 1.0
    return F.cross_entropy(logits, torch.arange(p.size(0)))


def fda_loss(visual: Tensor, text_cls: Tensor, group: int = 7, tmp: float = 1.0) -> Tensor:
    """§5.3 FDA: cosine of normalize(visual) and normalize(text_cls) per row; consecutive
    `group` rows form one pair's logits (positive first); CE to 0, mean over pairs."""
    sim = (F.normalize(visual, dim=-1) * F.normalize(text_cls, dim=-1)).sum(-1)
    logits = sim.view(-1, group) / tmp
    return F.cross_entropy(logits, torch.zeros(logits.size(0), dtype=torch.long))


def finetune_loss(out: FinetuneOutput, labels: Tensor, diff_labels: Tensor) -> Tensor:
    """§5.4 / I-Q10: sum of the per-token MLM CE + sum of the per-sample distractor CE."""
    mlm = mlm_token_losses(out.mlm_logits, labels).sum()
    diff = F.cross_entropy(out.distractor_logits, diff_labels, reduction="sum")
    return mlm + diff
