"""DFlash drafter: z-lab's published block-diffusion drafters (and ours trained in their architecture) in hybrid.

A DFlash checkpoint is a transformers folder: `config.json` is a Qwen3 config of the drafter (`num_hidden_layers`
drafter layers, the verifier's width) plus `block_size`, `num_target_layers` and `dflash_config` =
{`target_layer_ids`, `mask_token_id`}; `model.safetensors` holds Qwen3 decoder layers, `fc` and `hidden_norm`, and
a final `norm`. The drafter has no embedding or LM head: it uses the verifier's (Chen et al. 2026, "DFlash: Block
Diffusion for Flash Speculative Decoding"; z-lab/dflash `dflash/model.py`, vLLM `qwen3_dflash.py`).

One draft is one forward. The block is `[anchor, mask x (B - 1)]`, embedded by the verifier (the mask token's own
embedding for the masks). The context is the verifier's hidden states of `target_layer_ids` (hidden_states index
id + 1: index 0 is the embedding output) for every committed token but the anchor, fused as
`hidden_norm(fc(concat))`. Each drafter layer attends over [its keys/values of the fused context ; the block],
non-causally on full-attention layers, causally within a window on sliding-window ones (as vLLM and SGLang
serve `layer_types`). The verifier's LM head turns positions 1..B-1 into logits.

A context token's keys/values depend only on its own verifier states and position, so each is computed once, when
the token is committed, and kept in a side buffer of the verifier's cache (`DraftContext.side_buffer`): a rollback
of the verifier is a rollback of it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from drafters.base import Draft, DraftContext, Drafter, check_same_verifier
from drafters.block_diffusion import verifier_fingerprint
from drafters.context import gather_context, sync_context
from drafters.dflash_model import DFlashNetwork, dflash_value, layer_masks
from drafters.tree import tree_below

CONFIG_NAME = "config.json"
# The model code a folder carries for `AutoModel.from_pretrained(folder, trust_remote_code=True)` (z-lab's documented
# loading call): the file that defines the model here, under the name z-lab's folders give theirs.
MODEL_CODE, MODEL_CODE_NAME = Path(__file__).with_name("dflash_model.py"), "dflash.py"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"  # sharded weights, as transformers writes them
CONTEXT = "dflash-context"  # the side buffer of the projected context keys/values
ARCHITECTURE = "DFlashDraftModel"
# dflash_config fields this drafter reads; any other one changes the architecture (DFlash 2's selector, DSpark's
# projector, ...) and is refused rather than silently ignored.
DFLASH_FIELDS = (
    "target_layer_ids",
    "mask_token_id",
    "mask_token",
    "block_size",
    "num_target_layers",
    "causal",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
)
# Fields `PreTrainedConfig.to_dict` adds that say nothing about a drafter (the published configs omit them).
TRANSFORMERS_BOOKKEEPING = (
    "_name_or_path",
    "id2label",
    "label2id",
    "chunk_size_feed_forward",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "problem_type",
    "is_encoder_decoder",
)
FORMAT_HINT = (
    'a DFlash config.json has "dflash_config": {"target_layer_ids": [...], "mask_token_id": ...} beside a Qwen3 '
    "config (z-lab's published drafters, or `python -m drafters.training.train --arch dflash`)"
)


class DFlashModel(DFlashNetwork, nn.Module):
    """The weights of a DFlash checkpoint (`DFlashNetwork`) as hybrid's drafter runs them: its context
    keys/values computed once per committed token, the block drafted over them; the verifier's embedding rows in, its
    head's logits out."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.target_layer_ids = tuple(int(i) for i in dflash_value(config, "target_layer_ids"))
        self.mask_token_id = int(dflash_value(config, "mask_token_id"))
        self.block_size = int(dflash_value(config, "block_size"))
        self.add_network(config, len(self.target_layer_ids))
        self.embedding_scale = float(dflash_value(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(dflash_value(config, "output_multiplier", 1.0))
        self.softcap = float(dflash_value(config, "final_logit_softcapping", 0.0) or 0.0)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The verifier's hidden_states indices the context reads: target_layer_ids index decoder layers, and
        hidden_states[0] is the embedding output."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` casts the weights, never the RoPE frequencies: a bfloat16 frequency times a position of
        thousands is off by radians (transformers' checkpoints load them float32 too)."""
        super()._apply(fn, recurse)
        rope = self.rotary_emb
        if rope.inv_freq.dtype != torch.float32 and rope.inv_freq.device.type != "meta":
            exact = Qwen3RotaryEmbedding(self.config)
            rope.inv_freq = exact.inv_freq.to(rope.inv_freq.device)
            rope.original_inv_freq = exact.original_inv_freq.to(rope.inv_freq.device)
        return self

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Block inputs: rows of the verifier's embedding `weight` (unscaled, as the reference reads them)."""
        x = F.embedding(ids.to(weight.device), weight).to(self.fc.weight.device, self.dtype)
        return x * self.embedding_scale if self.embedding_scale != 1.0 else x

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The verifier head's logits of the block as the checkpoint scores them (multiplier, soft cap)."""
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap > 0 else logits

    def forward(self, block_embeds, block_positions, context, masks) -> torch.Tensor:
        """Final hidden states [S, q, hidden] of block inputs [S, q, hidden] at `block_positions` [S, q]; `context`
        from `context()`, `masks` from `layer_masks` (one per layer)."""
        return self.block_hidden(block_embeds, block_positions, context, masks)


# -- the folder ---------------------------------------------------------------------------------------------------


def read_config(path: str | Path) -> Qwen3Config:
    """The drafter's config from a DFlash folder, with every field the drafter needs present and sane."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: {FORMAT_HINT}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not JSON ({e}): re-download or re-save the drafter") from None
    architectures = raw.get("architectures") or [ARCHITECTURE]
    if architectures != [ARCHITECTURE]:
        raise ValueError(
            f"{file}: architectures {architectures} is not [{ARCHITECTURE!r}]: DFlashDrafter reads plain DFlash "
            "drafters only (DFlash 2 and other variants add modules it does not run)"
        )
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"{file} has no dflash_config: {FORMAT_HINT}")
    for name in ("target_layer_ids", "mask_token_id"):
        if dflash.get(name) is None:
            raise ValueError(f"{file}: dflash_config.{name} is missing: {FORMAT_HINT}")
    unknown = sorted(set(dflash) - set(DFLASH_FIELDS))
    if unknown:
        raise ValueError(
            f"{file}: dflash_config.{unknown[0]} is not part of the plain DFlash format DFlashDrafter runs "
            f"(it reads {', '.join(DFLASH_FIELDS)}): use a drafter in that format"
        )
    ids = dflash["target_layer_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(
            f"{file}: dflash_config.target_layer_ids must be a non-empty list of layer indices, got {ids!r}"
        )
    block = dflash.get("block_size", raw.get("block_size"))
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"{file}: block_size {block!r} must be an int >= 2 (the anchor and at least one mask)")
    try:
        config = Qwen3Config.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file} is not a valid Qwen3 config ({e}): {FORMAT_HINT}") from None
    # Qwen3Config drops `sliding_window` unless `use_sliding_window`; vLLM reads it for every sliding layer.
    config.sliding_window = raw.get("sliding_window")
    if "sliding_attention" in config.layer_types and not config.sliding_window:
        raise ValueError(f"{file}: layer_types has sliding_attention layers but no sliding_window: set the window size")
    return config


def weight_files(path: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists: plain file names in the folder (a folder
    comes from anyone, and its index must not send the loader elsewhere)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not an index with a weight_map ({e!r}): re-save the drafter") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map must map tensor names to shard files, got {weight_map!r}")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard:
                raise ValueError(
                    f"{index}: weight_map entry {name!r} names {shard!r}, which is not a shard's plain file name in "
                    "the folder: an index lists the folder's own files only; fix or remove the index"
                )
        return [path / shard for shard in sorted(set(weight_map.values()))]
    if not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{path / WEIGHTS_NAME} not found: a DFlash folder holds the drafter's weights there")
    return [path / WEIGHTS_NAME]


def load_model(path: str | Path, dtype: torch.dtype | None = None) -> DFlashModel:
    """The DFlashModel of a folder, in `dtype` (None: the checkpoint's own)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_config(path)
    state = {}
    for file in weight_files(path):
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"{file} is truncated or not safetensors ({e}): download the drafter again (or re-save it)"
            ) from None
    with torch.device("meta"):
        model = DFlashModel(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        problem = f"lacks {missing[:3]}" if missing else f"has tensors the format does not name: {extra[:3]}"
        raise ValueError(f"{path}'s weights do not match its config.json: it {problem}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"{path}: {name} is {tuple(state[name].shape)}, its config.json says {shape}: the config and the "
                "weights are of different drafters"
            )
    model.load_state_dict(state, assign=True)  # the file's tensors become the weights: no random init to overwrite
    model.rotary_emb = Qwen3RotaryEmbedding(config)  # its frequencies are computed, not stored
    return model.to(dtype or next(iter(state.values())).dtype).eval()


def save_model(model: DFlashModel, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The DFlash folder the reference loader, vLLM and SGLang read: config.json (with `auto_map`),
    model.safetensors (`dtype`) and the model code `dflash.py` that `AutoModel.from_pretrained(path,
    trust_remote_code=True)` runs."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items() if k not in TRANSFORMERS_BOOKKEEPING}
    # rope_theta at the top level too, where the published configs (transformers 4.x) keep it.
    config.update(
        architectures=[ARCHITECTURE],
        auto_map=AUTO_MAP,
        dtype=str(dtype).removeprefix("torch."),
        rope_theta=model.config.rope_parameters["rope_theta"],
    )
    if "sliding_attention" in model.config.layer_types:  # else Qwen3Config drops the window on loading
        config.update(use_sliding_window=True, sliding_window=model.config.sliding_window)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(MODEL_CODE, path / MODEL_CODE_NAME)


def check_verifier(config: Qwen3Config, verifier, fingerprint: bool = True) -> None:
    """Raise a ValueError naming the field and the fix unless a drafter of `config` fits `verifier`: its shape, and
    with `fingerprint` the verifier a folder hybrid trained records (`verifier_fingerprint`)."""
    text = verifier.config.get_text_config()
    vocab = verifier.get_input_embeddings().weight.shape[0]
    fix = "load the DFlash drafter trained for this verifier (or train one with --arch dflash)"
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    for name, mine, theirs in (
        ("hidden_size", config.hidden_size, text.hidden_size),
        ("target_hidden_size", target_hidden, text.hidden_size),
        ("vocab_size", config.vocab_size, vocab),
    ):
        if mine != theirs:
            raise ValueError(f"drafter {name} {mine} != verifier's {theirs}: {fix}")
    layers = dflash_value(config, "num_target_layers")
    if layers is not None and layers != text.num_hidden_layers:
        raise ValueError(f"drafter num_target_layers {layers} != the verifier's {text.num_hidden_layers} layers: {fix}")
    ids = dflash_value(config, "target_layer_ids")
    bad = [i for i in ids if not 0 <= i < text.num_hidden_layers]
    if bad:
        raise ValueError(
            f"dflash_config.target_layer_ids {bad} out of range for a verifier of {text.num_hidden_layers} layers "
            f"(0..{text.num_hidden_layers - 1}): {fix}"
        )
    mask = dflash_value(config, "mask_token_id")
    if not 0 <= mask < vocab:
        raise ValueError(f"dflash_config.mask_token_id {mask} outside the verifier's vocabulary [0, {vocab}): {fix}")
    trained_for = getattr(config, "verifier_fingerprint", None)
    if trained_for and fingerprint:  # a folder hybrid trained names its verifier (published ones name none)
        check_same_verifier(
            trained_for, verifier_fingerprint(verifier), "this drafter was trained for another verifier", fix
        )


class DFlashDrafter(Drafter):
    """The `Drafter` around a `DFlashModel` and its verifier: one forward drafts a block, chains are proposed.

    Args:
        model: the `DFlashModel` (`DFlashDrafter.from_pretrained` loads one from a DFlash folder).
        verifier: the verifier model (its embedding and LM head are the drafter's; its shape is checked).
        tokenizer: the verifier's tokenizer, if known (checked against the one passed to `generate`).
        block_size: positions per block at run time (anchor included), 2..the checkpoint's block size.
        max_nodes: propose token trees of up to this many nodes (None: chains), the best paths through the block's
            per-position distributions, at most `branching` children per node (`drafters.tree.tree_below`).
    """

    def __init__(
        self,
        model: DFlashModel,
        verifier,
        tokenizer=None,
        block_size: int | None = None,
        max_nodes: int | None = None,
        branching: int = 4,
    ):
        check_verifier(model.config, verifier)
        if (max_nodes is not None and max_nodes < 1) or branching < 1:
            raise ValueError(
                f"max_nodes ({max_nodes}) and branching ({branching}) must be >= 1 (max_nodes None: chains)"
            )
        self.max_nodes, self.branching = max_nodes, branching
        block_size = model.block_size if block_size is None else block_size
        if not 2 <= block_size <= model.block_size:
            raise ValueError(f"block_size {block_size} outside 2..{model.block_size} (the checkpoint's block size)")
        self.head = verifier.get_output_embeddings()
        # By the head: the last GPU when device_map spreads the verifier.
        self.device = self.head.weight.device
        self.model = model.to(self.device).eval()
        self.embedding = verifier.get_input_embeddings().weight
        self.vocab_size = self.embedding.shape[0]
        self.tokenizer = tokenizer
        self.hidden_layers = model.hidden_layers
        self.block_size, self.max_draft_len = block_size, block_size - 1
        weights = hashlib.sha256()
        for t in model.state_dict().values():  # the raw bytes: no float copy of a gigabyte drafter
            weights.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        # Schedulers keep acceptance statistics per drafter: another checkpoint or block size is another drafter.
        self.fingerprint = f"dflash:{weights.hexdigest()[:12]}:b{block_size}"
        if max_nodes is not None:
            self.fingerprint += f":n{max_nodes}:w{branching}"

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        verifier,
        tokenizer=None,
        block_size: int | None = None,
        dtype: torch.dtype | None = None,
        **kwargs,
    ) -> DFlashDrafter:
        """Load a DFlash folder for `verifier`; `dtype` defaults to the verifier's (bfloat16 for published pairs);
        `kwargs` are the drafter's own (max_nodes, branching)."""
        config = read_config(path)
        check_verifier(config, verifier, fingerprint=False)  # before reading the weights: a wrong shape fails at once
        return cls(load_model(path, dtype or verifier.dtype), verifier, tokenizer, block_size, **kwargs)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        save_model(self.model, path, dtype)

    # -- drafting -----------------------------------------------------------------------------------------------

    def _context(self, ctx: DraftContext) -> torch.Tensor:
        """Every row's context keys/values, [rows, capacity, layers, 2, kv_heads, d]: a side buffer of the cache."""
        attention = self.model.layers[0].self_attn
        per_token = (len(self.model.layers), 2, attention.num_kv_heads, attention.head_dim)
        return ctx.side_buffer(CONTEXT, per_token, self.model.dtype, self.device)

    def _block(self, ctx: DraftContext, given: Draft) -> torch.Tensor:
        """The block's tokens [B]: the anchor, the given tokens, then masks."""
        block = torch.full((self.block_size,), self.model.mask_token_id, dtype=torch.long, device=self.device)
        block[0] = ctx.input_ids[0, -1]
        block[1 : 1 + len(given)] = given.tokens.to(self.device)
        return block

    @torch.inference_mode()
    def block_logits(self, ctxs: list[DraftContext], blocks: torch.Tensor) -> torch.Tensor:
        """Logits [R, B - 1, vocab] of block positions 1.. for rows `ctxs` of one batch with block tokens [R, B], in
        one forward: row r's context is its first n_r slots of the side buffer, the slots past n_r are masked."""
        lengths = [
            sync_context(ctx, CONTEXT, self._context(ctx), self.model.context, type(self).__name__)[0] for ctx in ctxs
        ]
        static, size = ctxs[0].static, blocks.shape[1]
        context, slots = gather_context(ctxs, self._context(ctxs[0]), lengths)
        n = torch.tensor(lengths, device=self.device)
        positions = n[:, None] + torch.arange(size, device=self.device)
        keys = torch.arange(slots + size, device=self.device)
        key_positions = torch.where(keys < slots, keys, keys - slots + n[:, None])  # a slot's position is its index
        visible = None
        if static or len(set(lengths)) > 1:  # [context slots ; block]: a row sees its own n slots and the block
            visible = ((keys < n[:, None]) | (keys >= slots))[:, None, None, :].expand(-1, -1, size, -1)
        masks = layer_masks(self.model.kinds, positions, key_positions, visible)
        forward = self.model
        if static:
            forward = ctxs[0].compiled(self.model)
            if forward is not self.model:  # the last pass's output is consumed: CUDA graphs may reuse it
                torch.compiler.cudagraph_mark_step_begin()
        hidden = forward(self.model.embed(self.embedding, blocks), positions, context, masks)
        head_device = self.head.weight.device
        return self.model.finish_logits(self.head(hidden[:, 1:].to(head_device, self.head.weight.dtype))).float()

    def draft_from_logits(self, ctx: DraftContext, logits: torch.Tensor, given: Draft, max_tokens: int) -> Draft:
        """The chain to propose from a block's logits [B - 1, vocab]: `given` as it is, then per position the
        verifier-processed top-1 with its probability as confidence (or, under `ctx.do_sample`, a draw from q with q
        reported), each given the tokens before it."""
        k = min(max_tokens, self.block_size - 1)
        m = len(given)
        if self.max_nodes is not None and not ctx.do_sample:  # a tree below the given chain
            return tree_below(ctx, given, logits[m : self.block_size - 1], max_tokens, self.branching)
        if not ctx.do_sample and not ctx.reorders:  # the raw top-1 is the processed one: one argmax for all
            confidence, best = torch.softmax(logits[m:k], dim=-1).max(dim=-1)
            device = ctx.input_ids.device
            tokens = torch.cat([given.tokens.to(device), best.to(device)])
            given_confidence = given.confidence if given.confidence is not None else torch.ones(m)
            return Draft(tokens, None, torch.cat([given_confidence.float().to(device), confidence.to(device)]))
        prefix = torch.cat([ctx.input_ids, given.tokens.to(ctx.input_ids.device)[None]], dim=1)
        tokens, probs, confidence = [], [], []
        for i in range(m, k):
            token, q = ctx.choose(logits[i], prefix)
            tokens.append(token)
            probs.append(q)
            confidence.append(float(q[token]))
            prefix = torch.cat([prefix, prefix.new_tensor([[token]])], dim=1)
        device = ctx.input_ids.device
        new = Draft(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.stack(probs).to(device) if ctx.do_sample and probs else None,
            torch.tensor(confidence, device=device),
        )
        return new if m == 0 else concatenate(given, new, self.vocab_size)

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return self.fill(ctx, Draft.empty(ctx.input_ids.device), max_tokens)

    def fill(self, ctx: DraftContext, given: Draft, max_tokens: int) -> Draft:
        return self.fill_rows([self], [ctx], [given], [max_tokens])[0]

    def propose_rows(self, drafters: list[Drafter], ctxs: list[DraftContext], max_tokens: list[int]) -> list[Draft]:
        return self.fill_rows(drafters, ctxs, [Draft.empty(ctx.input_ids.device) for ctx in ctxs], max_tokens)

    @torch.inference_mode()
    def fill_rows(
        self, drafters: list[Drafter], ctxs: list[DraftContext], givens: list[Draft], max_tokens: list[int]
    ) -> list[Draft]:
        """Every row's block in one forward; the tokens are chosen row by row, in row order (so a sampled batch draws
        as row-by-row drafting does). Given tokens sit in the block as known positions."""
        blocks = torch.stack([self._block(ctx, given) for ctx, given in zip(ctxs, givens)])
        logits = self.block_logits(ctxs, blocks)
        return [
            drafter.draft_from_logits(ctx, row_logits, given, k)
            for drafter, ctx, row_logits, given, k in zip(drafters, ctxs, logits, givens, max_tokens)
        ]


def concatenate(given: Draft, new: Draft, vocab_size: int) -> Draft:
    """`given` followed by `new` (probs one-hot where a part has none, when the other has them)."""

    def probs(d: Draft) -> torch.Tensor:
        if d.probs is not None:
            return d.probs.float()
        return F.one_hot(d.tokens.long(), vocab_size).float()

    confidence = [d.confidence if d.confidence is not None else torch.ones(len(d)) for d in (given, new)]
    has_probs = given.probs is not None or new.probs is not None
    device = new.tokens.device
    return Draft(
        torch.cat([given.tokens.to(device), new.tokens]),
        torch.cat([probs(given).to(device), probs(new).to(device)]) if has_probs else None,
        torch.cat([c.float().to(device) for c in confidence]),
    )
