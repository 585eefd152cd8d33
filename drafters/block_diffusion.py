"""Block-diffusion drafter: fills a block of masked positions in one parallel pass, conditioned on the verifier.

The block is `[anchor, MASK, ..., MASK]` (B positions): the anchor is the token the verifier just chose,
the masks are the B - 1 tokens to draft. Attention is bidirectional inside the block. The context is not
text the drafter re-reads: it is the verifier's own hidden states of several layers, concatenated,
projected (linear + RMSNorm) and used as extra keys/values by every drafter layer (DFlash's design).
At draft time the verifier has states only up to the token BEFORE the anchor; training uses exactly that
visibility (drafters.training). The token embedding and LM head are the verifier's (frozen, never saved);
the head is restricted to a draft vocabulary (the tokens the verifier actually emits), which makes
training and drafting cheaper and keeps both in the same space.

Only the projected context keys/values are cached, one slot per committed token, in a side buffer of the
verifier's cache (`DraftContext.side_buffer`): a rollback of the verifier is a rollback of it (slots are
recomputed where the committed tokens changed).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import Draft, DraftContext, Drafter, check_same_verifier
from drafters.context import gather_context, sync_context
from drafters.tree import tree_below

CONFIG_NAME = "drafter_config.json"
CONTEXT = "block-context"  # the side buffer of the projected context keys/values
FEATURE_CLIP = 8.0
MASKED_INPUTS = ("anchor", "nearest_known")  # BlockDiffusionConfig.masked_input
WEIGHTS_NAME = "model.safetensors"


@dataclass
class BlockDiffusionConfig:
    hidden_size: int = 576
    num_layers: int = 1
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    block_size: int = 16  # anchor + block_size - 1 drafted positions
    target_layers: tuple[int, ...] = (2, 9, 16, 23, 30)  # indices into the verifier's hidden_states tuple
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    draft_vocab_size: int = 8192
    # What a masked position reads besides its mask embedding: "anchor" (the block's first token, mask embedding i
    # at position i) or "nearest_known" (the nearest known token to its left, mask embedding i - j for known j: after
    # a lookup or an earlier pass fixed positions 1..j, position j + 1 reads x_j as position 1 reads the anchor).
    masked_input: str = "anchor"
    verifier: dict = field(default_factory=dict)  # verifier_fingerprint() of the verifier it was trained for

    @classmethod
    def for_verifier(cls, model, **overrides) -> BlockDiffusionConfig:
        """A config whose width, heads and RoPE follow `model` (so its embedding and head fit)."""
        shape = verifier_geometry(model)
        defaults = dict(
            hidden_size=shape["hidden_size"],
            num_heads=shape["num_heads"],
            head_dim=shape["head_dim"],
            num_kv_heads=shape["num_kv_heads"],
            intermediate_size=shape["intermediate_size"],
            rope_theta=shape["rope_parameters"].get("rope_theta", 10000.0),
            rms_norm_eps=shape["norm_eps"],
            target_layers=spread_layers(shape["num_layers"]),
            verifier=verifier_fingerprint(model),
        )
        defaults.update(overrides)
        return cls(**defaults)


def spread_layers(num_layers: int, top: int | None = None) -> tuple[int, ...]:
    """Five hidden_states indices spread from low layers to `top` (default: the last, `num_layers`), deduplicated:
    DFlash fuses low, middle and high features."""
    top = num_layers if top is None else top
    return tuple(sorted({min(top, max(1, round(num_layers * f))) for f in (0.07, 0.3, 0.53, 0.77, 1.0)}))


def verifier_geometry(model) -> dict:
    """The shape a drafter layer for `model` copies: width, heads, MLP width, norm epsilon, RoPE and layer count, with
    the defaults of configs that do not name them (GPT-2's: no key/value heads, a 4x MLP, LayerNorm, no RoPE)."""
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    return {
        "hidden_size": text.hidden_size,
        "num_heads": heads,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "intermediate_size": getattr(text, "intermediate_size", None)
        or getattr(text, "n_inner", None)
        or 4 * text.hidden_size,
        "norm_eps": getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_epsilon", None) or 1e-5,
        "rope_parameters": dict(
            getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        ),
        "num_layers": text.num_hidden_layers,
        "max_position_embeddings": getattr(text, "max_position_embeddings", None) or 2048,
    }


def verifier_fingerprint(model) -> dict:
    """What must match between a checkpoint and the verifier it is loaded for."""
    text = model.config.get_text_config()
    embedding = model.get_input_embeddings().weight.detach()
    # Hashed in bfloat16 so the same verifier loaded in float32 or bfloat16 matches (and in float16 when its weights are
    # bfloat16 values within float16's range; float32 ones rounded to float16 can round to other bfloat16 values).
    data = embedding.to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes()
    return {
        "architecture": type(model).__name__,
        "hidden_size": text.hidden_size,
        "vocab_size": embedding.shape[0],
        "num_layers": text.num_hidden_layers,
        "embedding_sha256": hashlib.sha256(data).hexdigest()[:16],
    }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., n, head_dim] for integer `positions` [..., n] (Llama's rotate-half convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, heads, n, d]; cos/sin [S, n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DraftLayer(nn.Module):
    """A Llama decoder layer whose keys/values are [verifier context features ; block tokens]."""

    def __init__(self, c: BlockDiffusionConfig):
        super().__init__()
        self.c = c
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, num: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], num, self.c.head_dim).transpose(1, 2)  # [S, heads, n, d]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [S, kv_heads, n, d] of inputs x [S, n, hidden]."""
        k = apply_rotary(self._heads(self.k_proj(x), self.c.num_kv_heads), cos, sin)
        return k, self._heads(self.v_proj(x), self.c.num_kv_heads)

    def forward(self, x, context_k, context_v, cos, sin, mask):
        h = self.input_norm(x)
        q = apply_rotary(self._heads(self.q_proj(h), self.c.num_heads), cos, sin)
        k, v = self.keys_values(h, cos, sin)
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).flatten(2))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class BlockDiffusionModel(nn.Module):
    """The trainable part: context fusion, a mask embedding, the layers and a final norm.

    A context token's fused feature is its verifier states (fused) plus its own normalised embedding: the drafter
    reads which token sits where as directly as an AR drafter does, which copying from the context needs. Every
    block input gets the fused feature of the token before the anchor (EAGLE's input): the state that predicted
    the anchor is then in every position without an attention hop.
    """

    def __init__(self, config: BlockDiffusionConfig):
        super().__init__()
        c = self.config = config
        if c.masked_input not in MASKED_INPUTS:
            raise ValueError(f"masked_input {c.masked_input!r}: choose one of {', '.join(MASKED_INPUTS)}")
        self.fuse = nn.Linear(len(c.target_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.fuse_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.token_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # One mask embedding per block position (plus the embedding of a token it reads, see block_inputs): with identical
        # inputs, masked positions could tell apart only through RoPE, which one layer does poorly.
        self.mask_embedding = nn.Parameter(torch.zeros(c.block_size, c.hidden_size))
        self.feature_gate = nn.Parameter(torch.ones(c.hidden_size))  # scales the fused feature to the embeddings'
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("draft_vocab", torch.arange(c.draft_vocab_size), persistent=True)
        # Verifier states carry "massive activations" (a few dims up to ~25,000 while the rest are ~1-10): they are
        # standardised per dim with statistics of the training features, then clipped, before the projection.
        width = len(c.target_layers) * c.hidden_size
        self.register_buffer("feature_shift", torch.zeros(width), persistent=True)
        self.register_buffer("feature_scale", torch.ones(width), persistent=True)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def block_inputs(self, token_embeds: torch.Tensor, known: torch.Tensor, last_feature: torch.Tensor) -> torch.Tensor:
        """Inputs [..., B, hidden] of a block from its token embeddings [..., B, hidden] (anchor first), `known`
        [..., B] and `last_feature` [..., hidden] (the fused feature of the token before the anchor), which is
        added to every position. A masked position gets a mask embedding plus the embedding of the token it reads
        (`BlockDiffusionConfig.masked_input`): it then knows that token without attending to it, which an AR layer
        gets for free and a 1-layer block model otherwise learns slowly."""
        positions = torch.arange(token_embeds.shape[-2], device=known.device)
        if self.config.masked_input == "nearest_known":  # the nearest known position at or before each one
            source = torch.where(known, positions, 0).cummax(-1).values
        else:
            source = torch.zeros_like(known, dtype=torch.long)
        read = token_embeds.gather(-2, source[..., None].expand(token_embeds.shape))
        masked = self.mask_embedding[positions - source].to(token_embeds.dtype) + read
        inputs = torch.where(known[..., None], token_embeds, masked)
        return inputs + (self.feature_gate * last_feature)[..., None, :].to(inputs.dtype)

    def features(self, hidden_states: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Fused features [..., hidden] of verifier states [..., len(target_layers) * hidden] and the embeddings
        [..., hidden] of the tokens they were computed at."""
        x = (hidden_states.to(self.fuse.weight.dtype) - self.feature_shift) / self.feature_scale
        fused = self.fuse_norm(self.fuse(x.clamp(-FEATURE_CLIP, FEATURE_CLIP)))
        return fused + self.token_norm(token_embeds.to(fused.dtype))

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [S, kv_heads, n, d] of fused features [S, n, hidden] (see `features`)."""
        cos, sin = rotary(positions, self.config.head_dim, self.config.rope_theta)
        return [layer.keys_values(features, cos, sin) for layer in self.layers]

    def forward(self, block_embeds, block_positions, context, mask=None) -> torch.Tensor:
        """Final hidden states [S, q, hidden] of block inputs [S, q, hidden] at `block_positions` [S, q].

        `context` comes from `context()`; `mask` [S, 1, q, n + q] (True = may attend) or None (all visible).
        """
        cos, sin = rotary(block_positions, self.config.head_dim, self.config.rope_theta)
        x = block_embeds
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, k, v, cos, sin, mask)
        return self.norm(x)


def frozen_verifier_parts(model, draft_vocab: torch.Tensor) -> tuple[nn.Embedding, torch.Tensor]:
    """The verifier's token embedding and its LM head rows for `draft_vocab` (both frozen)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("BlockDiffusionDrafter needs a verifier whose LM head has no bias")
    return model.get_input_embeddings(), head.weight.detach()[draft_vocab.to(head.weight.device)]


class BlockDiffusionDrafter(Drafter):
    """The `Drafter` around a `BlockDiffusionModel` and the verifier it was trained for.

    Args:
        model: the trained `BlockDiffusionModel`.
        verifier: the verifier model (its embedding and head are used; its fingerprint must match).
        tokenizer: the verifier's tokenizer, if known (checked against the one passed to `generate`).
        steps: the most denoising passes per draft (1 = one parallel pass); the scheduler chooses
            1..steps each step (`ctx.steps`; the default scheduler learns which pays). With more, each pass fixes the
            longest run of leading still-masked positions whose confidence is >= `threshold` (at least
            one) and re-predicts the rest with them as input. Fixing a left-to-right prefix keeps
            rejection sampling exact: every token is drawn given only tokens to its left.
        threshold: see `steps`.
        block_size: positions per block at run time (anchor included), 2..the trained block size.
        max_nodes: propose token trees of up to this many nodes (None: chains). The tree holds the best paths
            through the block's per-position distributions (`drafters.tree.best_first_tree`), at most
            `branching` children per node; the scheduler verifies its best prefix. Trees need the match rule:
            under `acceptance="rejection"` (ctx.do_sample) the drafter proposes chains.

    `fill` drafts the rest of a block whose first positions another drafter gave (a lookup match, in a
    `drafters.ChainDrafter`): the model reads them as known positions, as a later denoising pass does.
    """

    def __init__(
        self,
        model: BlockDiffusionModel,
        verifier,
        tokenizer=None,
        steps: int = 1,
        threshold: float = 0.9,
        block_size: int | None = None,
        max_nodes: int | None = None,
        branching: int = 4,
    ):
        c = model.config
        block_size = c.block_size if block_size is None else block_size
        if not 2 <= block_size <= c.block_size:
            raise ValueError(f"block_size {block_size} outside 2..{c.block_size} (the block size it was trained with)")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if (max_nodes is not None and max_nodes < 1) or branching < 1:
            raise ValueError(
                f"max_nodes ({max_nodes}) and branching ({branching}) must be >= 1 (max_nodes None: chains)"
            )
        check_fingerprint(c.verifier, verifier_fingerprint(verifier))
        # On the device of the verifier's head, i.e. its last layer when device_map spreads it over GPUs.
        self.device = verifier.get_output_embeddings().weight.device
        self.model = model.to(self.device).eval()
        self.embedding, self.head = frozen_verifier_parts(verifier, model.draft_vocab)
        self.vocab_size = verifier.get_input_embeddings().weight.shape[0]
        self.tokenizer = tokenizer
        self.hidden_layers = tuple(c.target_layers)
        self.block_size, self.max_draft_len = block_size, block_size - 1
        self.steps, self.threshold, self.max_steps = steps, threshold, steps
        self.max_nodes, self.branching = max_nodes, branching
        weights = hashlib.sha256(
            b"".join(t.detach().cpu().float().numpy().tobytes() for t in model.state_dict().values())
        )
        # Schedulers keep acceptance statistics per drafter: another checkpoint or setting is another drafter.
        self.fingerprint = f"{weights.hexdigest()[:12]}:b{block_size}:s{steps}:t{threshold}"
        if max_nodes is not None:
            self.fingerprint += f":n{max_nodes}:w{branching}"

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The verifier's embedding of `ids`, on the drafter's device (the embedding may live on another GPU)."""
        return self.embedding(ids.to(self.embedding.weight.device)).to(self.device)

    # -- persistence ------------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> None:
        save_model(self.model, path)

    @classmethod
    def from_pretrained(cls, path: str | Path, verifier, **kwargs) -> BlockDiffusionDrafter:
        return cls(load_model(path), verifier, **kwargs)

    # -- drafting ---------------------------------------------------------------------------------

    def _context(self, ctx: DraftContext) -> torch.Tensor:
        """The projected context keys/values of every row, [rows, capacity, layers, 2, kv_heads, d], a side buffer
        of the verifier's cache (a rollback cuts it back with the verifier's own)."""
        c = self.model.config
        return ctx.side_buffer(
            CONTEXT, (c.num_layers, 2, c.num_kv_heads, c.head_dim), self.model.norm.weight.dtype, self.device
        )

    @torch.inference_mode()
    def block_logits(self, ctx: DraftContext, block: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [B - 1, V'] for block positions 1.. given block tokens [B] where `known` [B]."""
        return self.block_logits_rows([ctx], block[None], known[None])[0]

    @torch.inference_mode()
    def block_logits_rows(self, ctxs: list[DraftContext], blocks: torch.Tensor, knowns: torch.Tensor) -> torch.Tensor:
        """`block_logits` of several rows of one batch [R, B - 1, V'], in one forward of the block model: row r's
        context is its first n_r slots of the side buffer; slots past a row's length are masked."""
        return self._block_logits(ctxs, self._block_context(ctxs, blocks.shape[1]), blocks, knowns)

    def _block_context(self, ctxs: list[DraftContext], size: int) -> tuple:
        """What every denoising pass over the rows' blocks of `size` positions reads and none changes: the fused
        feature of the token before each anchor [R, hidden] (zeros if none), the rows' context keys/values, the
        block positions [R, size] and the attention mask."""
        lengths, states, tokens = [], [], []
        for ctx in ctxs:
            committed = ctx.input_ids[0]

            def project(states, positions, committed=committed):
                return self.model.context(self.model.features(states, self.embed(committed[positions])), positions)

            n, row_states = sync_context(ctx, CONTEXT, self._context(ctx), project, type(self).__name__)
            lengths.append(n)
            if n:
                states.append(row_states[0, n - 1])
                tokens.append(committed[n - 1])
        last = self.model.feature_gate.new_zeros(len(ctxs), self.model.feature_gate.shape[0])
        if states:  # one projection for every row that has a token before its anchor
            rows = [r for r, n in enumerate(lengths) if n]
            last[rows] = self.model.features(torch.stack(states), self.embed(torch.stack(tokens)))
        context, slots = gather_context(ctxs, self._context(ctxs[0]), lengths)
        n = torch.tensor(lengths, device=self.device)
        positions = n[:, None] + torch.arange(size, device=self.device)
        mask = None
        if ctxs[0].static or len(set(lengths)) > 1:  # [context slots ; block]: a row sees its own n slots and the block
            keys = torch.arange(slots + size, device=self.device)
            mask = ((keys < n[:, None]) | (keys >= slots))[:, None, None, :].expand(-1, 1, size, -1)
        return last, context, positions, mask

    def _block_logits(
        self, ctxs: list[DraftContext], block_context: tuple, blocks: torch.Tensor, knowns: torch.Tensor
    ) -> torch.Tensor:
        """Draft-vocabulary logits [R, B - 1, V'] of the rows' blocks [R, B] given `known` [R, B], reading
        `block_context` (`_block_context` of the same rows)."""
        last, context, positions, mask = block_context
        inputs = self.model.block_inputs(self.embed(blocks), knowns, last)
        forward = self.model
        if ctxs[0].static:
            forward = ctxs[0].compiled(self.model)
            if forward is not self.model:  # the last pass's output is consumed: CUDA graphs may reuse it
                torch.compiler.cudagraph_mark_step_begin()
        hidden = forward(inputs.to(self.model.norm.weight.dtype), positions, context, mask)[:, 1:]
        # One matrix product for every row's positions: a batched product with the shared head is several times slower.
        logits = hidden.reshape(-1, hidden.shape[-1]) @ self.head.T.to(hidden.dtype)
        return logits.view(*hidden.shape[:2], -1).float()

    def _start(self, ctx: DraftContext, given: Draft) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block [B], known [B], the given tokens' confidences [B - 1]) of a block whose first positions are `given`."""
        committed = ctx.input_ids[0]
        size, m = self.block_size, len(given)
        block = committed.new_zeros(size)
        block[0] = committed[-1]
        known = torch.zeros(size, dtype=torch.bool, device=block.device)
        known[: 1 + m] = True
        block[1 : 1 + m] = given.tokens
        given_confidence = torch.zeros(size - 1)  # for positions fixed before the last pass
        if given.confidence is not None:
            given_confidence[:m] = given.confidence
        return block, known, given_confidence

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return self.fill(ctx, Draft.empty(ctx.input_ids.device), max_tokens)

    def propose_rows(self, drafters: list[Drafter], ctxs: list[DraftContext], max_tokens: list[int]) -> list[Draft]:
        if not self._draft_together(ctxs):
            return super().propose_rows(drafters, ctxs, max_tokens)
        return self._fill_together(drafters, ctxs, [Draft.empty(ctx.input_ids.device) for ctx in ctxs], max_tokens)

    def fill_rows(
        self, drafters: list[Drafter], ctxs: list[DraftContext], givens: list[Draft], max_tokens: list[int]
    ) -> list[Draft]:
        if not self._draft_together(ctxs):
            return super().fill_rows(drafters, ctxs, givens, max_tokens)
        return self._fill_together(drafters, ctxs, givens, max_tokens)

    def _passes(self, ctx: DraftContext) -> int:
        return self.steps if ctx.steps is None else min(ctx.steps, self.steps)

    def _draft_together(self, ctxs: list[DraftContext]) -> bool:
        """Whether rows draft together: rows taking the same number of denoising passes share each pass's forward
        of the block model (the choice of tokens stays per row, in row order, so a sampled batch draws as row-by-row
        drafting)."""
        return len(ctxs) > 1 and len({self._passes(ctx) for ctx in ctxs}) == 1

    @torch.inference_mode()
    def _fill_together(
        self, drafters: list[Drafter], ctxs: list[DraftContext], givens: list[Draft], max_tokens: list[int]
    ) -> list[Draft]:
        """Each row's block (its first positions `givens`), denoised by `_passes` passes, each one forward of every
        row: a pass fixes each row's first masked position and the confident masked run after it."""
        starts = [drafter._start(ctx, given) for drafter, ctx, given in zip(drafters, ctxs, givens)]
        blocks, knowns = torch.stack([s[0] for s in starts]), torch.stack([s[1] for s in starts])
        confidences = [s[2] for s in starts]
        steps, block_context = self._passes(ctxs[0]), self._block_context(ctxs, blocks.shape[1])
        for step in range(steps):
            logits = self._block_logits(ctxs, block_context, blocks, knowns)
            if step == steps - 1 or not bool((~knowns[:, 1:]).any()):
                break
            for row_logits, block, known, confidence in zip(logits, blocks, knowns, confidences):
                self._fix_leading_run(row_logits, block, known, confidence)
        return [
            drafter._choose(ctx, row_logits, block, known, confidence, given, k)
            for drafter, ctx, row_logits, block, known, confidence, given, k in zip(
                drafters, ctxs, logits, blocks, knowns, confidences, givens, max_tokens
            )
        ]

    def _fix_leading_run(
        self, logits: torch.Tensor, block: torch.Tensor, known: torch.Tensor, given_confidence: torch.Tensor
    ) -> None:
        """Fix, in place, the block's first masked position and the run of masked positions after it whose
        confidence is >= `threshold`, to their most likely tokens (nothing if none is masked)."""
        masked = ~known[1:]
        if not bool(masked.any()):
            return
        confidence, best = torch.softmax(logits, -1).max(-1)
        first = int(masked.nonzero()[0])
        run = first + 1
        while run < self.block_size - 1 and bool(masked[run]) and float(confidence[run]) >= self.threshold:
            run += 1
        block[1 + first : 1 + run] = self.model.draft_vocab[best[first:run]].to(block.dtype)
        known[1 + first : 1 + run] = True
        given_confidence[first:run] = confidence[first:run].cpu()

    def fill(self, ctx: DraftContext, given: Draft, max_tokens: int) -> Draft:
        return self._fill_together([self], [ctx], [given], [max_tokens])[0]

    def _choose(self, ctx, logits, block, known, given_confidence, given, max_tokens) -> Draft:
        """Tokens for the first `max_tokens` draft positions: known ones as they are (the given ones with their
        probs), the rest chosen from logits."""
        vocab = self.model.draft_vocab
        if self.max_nodes is not None and not ctx.do_sample:
            return self._tree(ctx, logits, block, known, given_confidence, max_tokens)
        k = min(max_tokens, self.block_size - 1)
        if (
            not ctx.do_sample and not ctx.reorders
        ):  # outside the draft vocabulary the logits are -inf: top-1 over it is the whole answer
            probs_v = torch.softmax(logits[:k], dim=-1)
            conf_v, best = probs_v.max(dim=-1)
            tokens_v = torch.where(known[1 : k + 1], block[1 : k + 1], vocab[best].to(block.dtype))
            conf_v = torch.where(known[1 : k + 1].cpu(), given_confidence[:k], conf_v.cpu())
            return Draft(tokens_v.to(ctx.input_ids.device), None, conf_v.to(ctx.input_ids.device))
        tokens, probs, confidence = [], [], []
        prefix = ctx.input_ids
        for i in range(k):
            full = logits.new_full((self.vocab_size,), -math.inf)
            full[vocab] = logits[i]
            if bool(known[i + 1]):  # given or fixed by an earlier pass: as it is
                token = int(block[i + 1])
                if i < len(given) and given.probs is not None:  # the distribution the giver drew it from
                    q = given.probs[i].to(full.device, full.dtype)
                else:  # a deterministic proposal
                    q = torch.zeros_like(full)
                    q[token] = 1.0
                conf = float(given_confidence[i])
            else:
                token, q = ctx.choose(full, prefix)
                conf = float(q[token])
            tokens.append(token)
            probs.append(q)
            confidence.append(conf)
            prefix = torch.cat([prefix, prefix.new_tensor([[token]])], dim=1)
        device = ctx.input_ids.device
        return Draft(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.stack(probs).to(device) if ctx.do_sample and probs else None,
            torch.tensor(confidence, device=device),
        )

    def _tree(self, ctx, logits, block, known, given_confidence, max_tokens) -> Draft:
        """The known leading positions as a chain, then the best-first tree of the rest over the block's
        per-position distributions (`drafters.tree.tree_below`)."""
        device = ctx.input_ids.device
        depth = self.block_size - 1
        fixed = known[1:].cpu()
        j = min(int(fixed.int().cumprod(0).sum()), max_tokens)  # the leading run of known positions
        chain = Draft(block[1 : 1 + j].to(device), None, given_confidence[:j].to(device))
        if j == depth:
            return chain
        vocab = self.model.draft_vocab
        return tree_below(ctx, chain, logits[j:depth], max_tokens, self.branching, vocab, self.vocab_size)


def check_fingerprint(expected: dict, actual: dict) -> None:
    check_same_verifier(
        expected,
        actual,
        "this drafter was trained for another verifier",
        "load a checkpoint trained for this verifier, or train one with `python -m drafters.training.train`",
    )


def save_model(model: BlockDiffusionModel, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Config + weights; floating-point tensors cast to `dtype` if given (loading casts them back to the model's)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        name: (t.to(dtype) if dtype and t.is_floating_point() else t).detach().cpu().contiguous()
        for name, t in model.state_dict().items()
    }
    save_file(state, str(path / WEIGHTS_NAME))
    (path / CONFIG_NAME).write_text(json.dumps(asdict(model.config), indent=2) + "\n")


def load_model(path: str | Path) -> BlockDiffusionModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found: a BlockDiffusionDrafter checkpoint is a folder with {CONFIG_NAME} "
                f"and {WEIGHTS_NAME} (written by save_pretrained)"
            )
    try:
        raw = json.loads(config_file.read_text())
        raw["target_layers"] = tuple(raw["target_layers"])
        config = BlockDiffusionConfig(**raw)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{config_file} is not a valid drafter config ({e}): re-save the checkpoint") from None
    try:
        state = load_file(str(weights_file))
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{weights_file} is corrupt or not safetensors ({e}): re-save or retrain the checkpoint"
        ) from None
    model = BlockDiffusionModel(config)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{weights_file} does not match {config_file}: {str(e).splitlines()[0]}") from None
    return model.eval()
