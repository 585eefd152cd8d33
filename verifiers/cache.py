"""One cache for the verifier and the drafter: preallocated, position-indexed, one length per row.

Row b's token at position p lives in slot p of every layer; prompts enter without their left padding,
so a slot index is a position. A forward writes its q tokens at slots `lengths[b] .. lengths[b]+q-1`
of each row and attends through a mask built from the lengths, so rows of different lengths share one
batched forward. **Rollback** is moving a row's length back (as in gpt-fast): nothing is copied or
recomputed, the rejected drafts' slots are overwritten by the next forward.

**Masked prompt tokens** (an attention_mask with zeros) do not enter the cache: `generate` hides them from every
query and numbers the unmasked tokens 0, 1, ..., as the slots here do. Its sliding windows, though, are measured in
its own cache positions, which count a masked token's slot: a token after a hole sees one real token fewer in its
window. `mark_masked` records, per slot, how many masked tokens `generate` would hold between the row's first
token and this one, and sliding masks measure the window in those positions.

**Side buffers** hold other per-token state the same way, slot p for position p: named tensors
[rows, capacity, *per_token] with a valid length per row, which a rollback cuts back, `select_rows`
selects and growth widens, as it does the keys/values. The verifier's kept hidden states are one
(`HIDDEN`, valid for every cached token); a drafter keeps its own per-token state in others (the block
drafter's projected context keys/values), valid up to what it marked computed.

**Static shapes** (`static=True`, `cache_implementation="static"`): every forward reads all `capacity`
slots through the mask and writes through an index tensor, so a forward of q tokens has the same shapes
at every step and a compiled forward (CUDA graphs) replays instead of re-tracing; the buffers never grow.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from verifiers.verdicts import probe_tokens, probed

# Attention implementations that take the 4D additive masks built here. Others (flash_attention_2)
# build their own causal mask, which is right only when every row has the same length.
MASKED_ATTENTION = ("eager", "sdpa")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN = "hidden"  # the side buffer of the verifier's kept hidden states
# The width `cache_feed_problem` probes for a forward of several tokens: the pending token and two drafts.
SEVERAL_TOKENS = 3


class CacheMemoryError(MemoryError):
    """The cache for this batch does not fit: the message names the batch size that does."""


class _RowLayer(CacheLayerMixin):
    """One layer's keys/values [batch, kv_heads, capacity, head_dim]; writes where its `SharedCache` says."""

    is_croppable = True
    is_sliding = False  # every slot is kept; sliding windows are applied by the mask

    def __init__(self, owner: SharedCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, heads = key_states.shape[:2]
        self.device = key_states.device  # with device_map="auto", the device of this layer
        capacity = self.owner.capacity
        self.keys = self.owner.allocate((rows, heads, capacity, key_states.shape[-1]), key_states.dtype, self.device)
        self.values = self.owner.allocate(
            (rows, heads, capacity, value_states.shape[-1]), value_states.dtype, self.device
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.owner.write(self.keys, key_states, dim=2)
        self.owner.write(self.values, value_states, dim=2)
        end = self.owner.end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Only read by a model that builds its own mask, i.e. when all rows have one length.
        return self.owner.lengths[0] + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return self.owner.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            indices = indices.to(self.keys.device)
            self.keys, self.values = self.keys[indices], self.values[indices]


class SharedCache(Cache):
    """The verifier's keys/values for every row, plus side buffers: its kept hidden states and a drafter's state.

    Args:
        model: the verifier (its config gives the layers and attention pattern).
        batch_size: rows.
        capacity: slots per row, i.e. the longest sequence (prompt + new tokens + a draft) it will hold.
            Buffers are allocated once at this size; a longer sequence grows them (a copy), never per step.
        hidden_width: width of the kept hidden states per token (0: none kept).
        static: the static-shape layout (module docstring): attention reads every slot, capacity is final.
    """

    def __init__(
        self,
        model,
        batch_size: int,
        capacity: int,
        hidden_width: int = 0,
        static: bool = False,
        windows_by_mask: bool = False,
    ):
        text = model.config.get_text_config()
        self.windows_by_mask = windows_by_mask
        self.sources = cache_layer_sources(text)
        super().__init__(layers=[_RowLayer(self) for _ in self.sources])
        self.capacity = max(int(capacity), 1)
        self.static = static
        self.lengths = [0] * batch_size  # tokens cached per row
        self.device, self.dtype, self.config = model.device, model.dtype, model.config
        self.layer_types, self.window = attention_pattern(text)
        check_fits(model, batch_size, self.capacity, hidden_width)
        self.side: dict[str, torch.Tensor] = {}  # name -> [rows, capacity, *per_token], see `side_buffer`
        self.side_lengths: dict[str, list[int]] = {}  # name -> its valid tokens per row
        if hidden_width:  # where the drafter reads them: by the head (the last GPU under device_map="auto")
            self.side_buffer(HIDDEN, (hidden_width,), model.dtype, model.get_output_embeddings().weight.device)
        self._write_index: torch.Tensor | None = None  # [rows, q] slots of the forward in flight
        self._write_start: int | None = None  # their common first slot, when every row starts at the same one
        self._tree: tuple[torch.Tensor, torch.Tensor] | None = None  # the fed token tree's depths and visibility
        self._forward_start: list[int] = []  # each row's length before the last forward
        self.holes: torch.Tensor | None = None  # [rows, P + 1] masked prompt tokens before each slot (`mark_masked`)
        # The prefill through the model's own mask even over holes (`Verifier.prefill_rows`: a model whose own mask
        # ignores its window attends over a holed prompt in full under `generate`).
        self.prefill_by_own_mask = False
        self.end = 0  # slots attention reads this forward: max(lengths) + q

    # -- memory -------------------------------------------------------------------------------------

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
        try:
            buffer = torch.zeros(shape, dtype=dtype, device=self.device if device is None else device)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if isinstance(error, RuntimeError) and "alloc" not in str(error).lower():
                raise
            raise CacheMemoryError(
                f"allocating the cache ({shape_bytes(shape, dtype) / 2**20:.0f} MiB for "
                f"{shape[0]} rows) failed: {error}. Pass fewer rows per call"
            ) from error
        if self.static:  # written in place by a compiled forward: CUDA graphs need a fixed address
            torch._dynamo.mark_static_address(buffer)
        return buffer

    def grow(self, buffer: torch.Tensor, dim: int) -> torch.Tensor:
        """`buffer` with `dim` widened to the current capacity, contents kept."""
        shape = list(buffer.shape)
        shape[dim] = self.capacity
        bigger = self.allocate(tuple(shape), buffer.dtype, buffer.device)
        bigger.narrow(dim, 0, buffer.shape[dim]).copy_(buffer)
        return bigger

    def reserve(self, slots: int) -> None:
        """Make room for `slots` per row (geometric growth, so a long generation copies O(log n) times)."""
        if slots > self.capacity:
            if self.static:
                raise RuntimeError(
                    f"a static cache of {self.capacity} slots cannot hold {slots}: size it for the whole call"
                )
            self.capacity = max(slots, 2 * self.capacity)
            for layer in self.layers:  # layers not yet initialised are allocated at the new capacity
                if layer.is_initialized:
                    layer.keys, layer.values = self.grow(layer.keys, 2), self.grow(layer.values, 2)
            self.side = {name: self.grow(buffer, 1) for name, buffer in self.side.items()}

    # -- one forward: where it writes, what it may see -------------------------------------------------

    def begin(self, q: int, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Prepare a forward of q tokens per row; return their position ids [rows, q].

        tree: (depths [rows, q], sees [rows, q, q] bool) when the fed tokens are a token tree: fed token i of row b
        sits at position lengths[b] + depths[b, i] and attends to the cache and to the fed tokens j with
        sees[b, i, j] (its ancestors and itself). Without it, fed token i sits at lengths[b] + i and sees all
        fed tokens before it. Either way it is written to slot lengths[b] + i.
        """
        self.reserve(max(self.lengths) + q)
        starts = torch.tensor(self.lengths, device=self.device)
        self._forward_start = list(self.lengths)
        self._write_index = starts[:, None] + torch.arange(q, device=self.device)
        self._tree = None if tree is None else (tree[0].to(self.device), tree[1].to(self.device))
        # Static shapes write through the index tensor even when rows are aligned: a slice start would be a
        # Python int that changes every step, i.e. a new graph. The prefill runs eagerly either way, and as in
        # `generate` through the model's own mask over the prompt's slots alone (`needs_mask`).
        prefill = not any(self.lengths)
        self._write_start = self.lengths[0] if len(set(self.lengths)) == 1 and (prefill or not self.static) else None
        self.end = self.capacity if self.static and not prefill else max(self.lengths) + q
        return self._write_index if tree is None else starts[:, None] + self._tree[0]

    def mark_masked(self, masks: list[torch.Tensor | None]) -> None:
        """Record each row's prompt mask (1-D, 0 for a masked token; None: no mask) so that sliding windows count
        masked tokens as `generate` does. Only holes after a row's first unmasked token matter (leading ones shift
        every position alike), and only on sliding layers: otherwise nothing is kept and nothing changes."""
        holes = [None if mask is None else prompt_holes(mask) for mask in masks]
        if "sliding_attention" not in self.layer_types or not any(h is not None and bool(h[-1]) for h in holes):
            self.holes = None
            return
        holes = [torch.zeros(1, dtype=torch.long) if h is None else h for h in holes]
        width = max(h.shape[0] for h in holes)
        self.holes = torch.stack([torch.cat([h, h[-1:].expand(width - h.shape[0])]) for h in holes]).to(self.device)

    def _window_positions(self, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`positions` [rows, ...] of the tokens in `slots` (same shape) as `generate`'s cache numbers them: plus the
        masked prompt tokens before each slot."""
        if self.holes is None:
            return positions
        index = slots.clamp(max=self.holes.shape[1] - 1).reshape(slots.shape[0], -1)
        return positions + self.holes.gather(1, index).view(slots.shape)

    @property
    def aligned(self) -> bool:
        """Whether the forward in flight starts at the same slot in every row."""
        return self._write_start is not None

    @property
    def needs_mask(self) -> bool:
        """Whether the forward in flight needs `attention_mask`: the model's own causal mask is right only for a
        chain fed at the same slot in every row (the cache then ends at length + q in each), with no masked prompt
        token inside a sliding window, and, where `windows_by_mask`, not past the sliding window after the prefill.

        `generate` runs the prefill through the model's own mask, then each step through a cache that keeps only
        the window: a model whose own mask ignores the window its config declares (Moshi's) attends fully over the
        prompt and through the window after it. The prefill here is the model's own too, and past the window a step
        takes the masks built here, which window as that cache does (and as a model that honours its window)."""
        started = any(self._forward_start)  # not the prefill
        if not self.aligned or self._tree is not None:
            return True
        if self.holes is not None and (started or not self.prefill_by_own_mask):
            return True
        return self.windows_by_mask and self.window is not None and started and self.end > self.window

    def write(self, buffer: torch.Tensor, states: torch.Tensor, dim: int) -> None:
        """Write a forward's states [rows, ..., q, ...] (q on `dim`) into `buffer` at each row's slots."""
        q = states.shape[dim]
        if self._write_start is not None:  # all rows aligned (always at batch 1): a plain slice copy
            buffer.narrow(dim, self._write_start, q).copy_(states)  # copy_ moves device and dtype
            return
        shape = [1] * states.dim()
        shape[0], shape[dim] = states.shape[0], q
        index = self._write_index.to(buffer.device).view(shape).expand_as(states)
        buffer.scatter_(dim, index, states.to(buffer.device, buffer.dtype))

    def attention_mask(self, q: int):
        """Additive masks [rows, 1, q, end] for the forward `begin(q)` prepared, one per layer type in use.

        A fed token sees the row's cached slots and the fed tokens `begin` says (within the sliding window of its
        position, on sliding layers); slots past a row's length hold stale drafts and stay hidden.
        """
        rows = self._write_index.shape[0]
        keys = torch.arange(self.end, device=self.device)
        if self._tree is None:
            query_pos = self._write_index[:, :, None]  # [rows, q, 1]
            key_pos = keys
            visible = keys <= query_pos
        else:
            depths, sees = self._tree
            starts = self._write_index[:, :1]  # [rows, 1]
            offset = keys - starts  # [rows, end]: which fed token a slot holds, where 0 <= offset < q
            fed = (offset >= 0) & (offset < q)
            j = offset.clamp(0, q - 1)
            visible = (offset < 0)[:, None] | (sees.gather(2, j[:, None].expand(-1, q, -1)) & fed[:, None])
            key_pos = torch.where(fed, starts + depths.gather(1, j), keys)[:, None]  # [rows, 1, end]
            query_pos = (starts + depths)[:, :, None]
        # The window in generate's cache positions: masked prompt tokens count (`mark_masked`).
        query_pos = self._window_positions(query_pos, self._write_index[:, :, None])
        key_pos = self._window_positions(key_pos, keys.expand(rows, 1, -1))
        masks = {}
        for kind in set(self.layer_types):
            seen = visible & (key_pos > query_pos - self.window) if kind == "sliding_attention" else visible
            masks[kind] = torch.zeros(seen.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~seen, torch.finfo(self.dtype).min
            )[:, None]
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def commit(self, q: int, hidden: torch.Tensor | None = None) -> None:
        """After the forward: every row now holds its q fed tokens (rollback drops the rejected ones)."""
        if hidden is not None and HIDDEN in self.side:
            self.write(self.side[HIDDEN], hidden, dim=1)
        self.lengths = [n + q for n in self.lengths]
        if HIDDEN in self.side:
            self.side_lengths[HIDDEN] = list(self.lengths)
        self._write_index, self._write_start, self._tree = None, None, None

    # -- rollback and finished rows ------------------------------------------------------------------

    def rollback(self, drop: list[int]) -> None:
        """Forget the last drop[b] tokens of row b (rejected drafts): the lengths move back, nothing else."""
        if len(drop) != len(self.lengths) or any(not 0 <= d <= n for d, n in zip(drop, self.lengths)):
            raise ValueError(f"cannot roll back {drop} tokens of rows holding {self.lengths}")
        self.lengths = [n - d for n, d in zip(self.lengths, drop)]
        # Side state of tokens that were just dropped is stale (a drafter recomputes it on its next draft).
        self.side_lengths = {
            name: [min(m, n) for m, n in zip(valid, self.lengths)] for name, valid in self.side_lengths.items()
        }

    def keep(self, kept: list[list[int]]) -> None:
        """After a forward: row b keeps its fed tokens kept[b] (offsets into that forward, increasing), moved to
        consecutive slots after what the row held before; the rest is dropped. A prefix moves nothing (a
        rollback); a tree's accepted path is copied down, keys, values and side state alike, recomputing nothing."""
        for b, offsets in enumerate(kept):
            start = self._forward_start[b]
            if any(not 0 <= o < self.lengths[b] - start for o in offsets) or sorted(set(offsets)) != list(offsets):
                raise ValueError(f"row {b} cannot keep fed tokens {offsets} of the {self.lengths[b] - start} it holds")
            moved = [(start + o, start + i) for i, o in enumerate(offsets) if o != i]
            if moved:
                src = torch.tensor([s for s, _ in moved], device=self.device)
                dst = torch.tensor([d for _, d in moved], device=self.device)
                for layer in self.layers:
                    if layer.is_initialized:
                        for buffer in (layer.keys, layer.values):
                            buffer[b, :, dst.to(buffer.device)] = buffer[b, :, src.to(buffer.device)]
                for buffer in self.side.values():
                    buffer[b, dst.to(buffer.device)] = buffer[b, src.to(buffer.device)]
        self.rollback([n - start - len(offsets) for n, start, offsets in zip(self.lengths, self._forward_start, kept)])

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order), e.g. drop finished ones so they stop costing work."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.batch_select_indices(index)
        self.side = {name: b[index.to(b.device)] for name, b in self.side.items()}
        self.lengths = [self.lengths[r] for r in rows]
        if self.holes is not None:
            self.holes = self.holes[index]
        self.side_lengths = {name: [valid[r] for r in rows] for name, valid in self.side_lengths.items()}
        if self.static:  # the selected rows are new buffers: fixed addresses again
            for buffer in self.buffers():
                torch._dynamo.mark_static_address(buffer)

    def buffers(self) -> list[torch.Tensor]:
        """Every allocated tensor: keys and values per layer, then the side buffers."""
        kv = [t for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values)]
        return kv + list(self.side.values())

    # -- reading -------------------------------------------------------------------------------------

    def hidden_states(self, row: int) -> torch.Tensor | None:
        """Kept hidden states of row `row`'s cached tokens: [1, lengths[row], width]."""
        if HIDDEN not in self.side:
            return None
        return self.side[HIDDEN][row : row + 1, : self.side_length(HIDDEN, row)]

    def side_buffer(self, name: str, per_token: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """The side buffer `name` [rows, capacity, *per_token], allocated on first use (valid for no token yet):
        row b's slots 0 .. side_length(name, b) - 1 hold state of its tokens at those positions; its owner
        writes the next slots and then calls `mark_computed`. Read it again after the cache grows."""
        if name not in self.side:
            self.side[name] = self.allocate((len(self.lengths), self.capacity, *per_token), dtype, device)
            self.side_lengths[name] = [0] * len(self.lengths)
        buffer = self.side[name]
        if tuple(buffer.shape[2:]) != tuple(per_token) or buffer.dtype != dtype:
            raise ValueError(
                f"side buffer {name!r} holds {tuple(buffer.shape[2:])} {buffer.dtype} per token, "
                f"not {tuple(per_token)} {dtype}"
            )
        return buffer

    def side_length(self, name: str, row: int) -> int:
        """Tokens of row `row` whose state side buffer `name` holds (0 before it is allocated)."""
        return self.side_lengths[name][row] if name in self.side_lengths else 0

    def mark_computed(self, name: str, row: int, length: int) -> None:
        """Side buffer `name` now holds row `row`'s state for its first `length` tokens (at most the cached ones)."""
        if name not in self.side:
            raise KeyError(f"no side buffer {name!r}: allocate it with side_buffer first")
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"side state {name!r} for {length} tokens of row {row}, which caches {self.lengths[row]}")
        self.side_lengths[name][row] = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[0] if self.lengths else 0

    def to_dynamic(self, row: int = 0):
        """A transformers `DynamicCache` holding row `row`'s cached tokens, to continue with `model.generate`."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)  # as `generate` builds it (sliding layers keep their window)
        # A looped model's extra layers, as it appends them to a cache of one layer per model layer
        cache.layers += [copy.deepcopy(cache.layers[source]) for source in self.sources[len(cache.layers) :]]
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized:  # a layer that stores nothing (KV sharing): neither does generate's
                continue
            n = self.lengths[row]
            cache.update(layer.keys[row : row + 1, :, :n].clone(), layer.values[row : row + 1, :, :n].clone(), i)
        return cache


def tree_layout(parents: list[list[int]], width: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [rows, width], sees [rows, width, width] bool) of fed token trees for `SharedCache.begin`.

    Row b feeds width tokens; fed token i > 0 continues fed token parents[b][i - 1] + 1 (a parent of -1 is fed
    token 0, the pending token, at depth 0). A token sees its ancestors and itself. Fed tokens past
    len(parents[b]) + 1 are padding: each continues the one before it, as a chain would.
    """
    rows = len(parents)
    parent = torch.arange(-1, width - 1).repeat(rows, 1)  # [rows, width]: fed index of each fed token's parent
    for b, nodes in enumerate(parents):
        if len(nodes) >= width:
            raise ValueError(f"row {b} has {len(nodes)} tree nodes, which do not fit a forward of {width} tokens")
        parent[b, 1 : 1 + len(nodes)] = torch.tensor(nodes, dtype=torch.long) + 1
    depths = torch.zeros(rows, width, dtype=torch.long)
    sees = torch.zeros(rows, width, width, dtype=torch.bool)
    sees[:, 0, 0] = True
    for i in range(1, width):  # parents come first, so one pass in order fills every row's ancestor sets
        p = parent[:, i]
        depths[:, i] = depths[torch.arange(rows), p] + 1
        sees[:, i] = sees[torch.arange(rows), p]
        sees[:, i, i] = True
    return depths.to(device), sees.to(device)


def prompt_holes(mask: torch.Tensor) -> torch.Tensor:
    """[n' + 1] for a prompt mask [n] with n' ones: entry i counts the masked tokens between the first unmasked token
    and unmasked token i; the last entry counts those of the whole prompt, which every new token follows."""
    kept = mask.nonzero()[:, 0].cpu()
    if kept.numel() == 0:
        raise ValueError("an attention_mask row masks every token: each prompt needs at least one unmasked token")
    holes = kept - kept[0] - torch.arange(kept.shape[0])
    return torch.cat([holes, torch.tensor([mask.shape[0] - kept[0] - kept.shape[0]])])


def attention_pattern(text_config) -> tuple[list[str], int | None]:
    """Each layer's attention kind, read as transformers reads it for its own caches (`layer_types`, else each
    layer's `sliding_window` / `attention_chunk_size`), and the sliding window; raises for what the masks built
    here cannot express."""
    name = type(text_config).__name__
    raw, kwargs = get_layer_types_and_kwargs(text_config)
    # A layer that stores nothing ("dummy": one that reads another layer's keys and values, Gemma 3n's and Gemma 4's
    # KV sharing, or one without attention) is masked as its config names it.
    declared = getattr(text_config, "layer_types", None) or []
    types = [
        (declared[i] if i < len(declared) and declared[i] in LAYER_TYPES else "full_attention")
        if kind == "dummy"
        else kind
        for i, kind in enumerate(raw)
    ]
    odd = sorted(set(types) - set(LAYER_TYPES))
    if odd:
        raise ValueError(f"{name} has {odd} layers: hybrid's cache serves full and sliding-window attention only")
    windows = {kw.get("sliding_window") for kind, kw in zip(raw, kwargs) if kind == "sliding_attention"}
    if None in windows:
        raise ValueError(f"{name} has sliding-attention layers but no sliding_window size")
    if len(windows) > 1:
        raise ValueError(f"{name} has sliding layers of different windows {sorted(windows)}: hybrid's masks take one")
    return list(types), next(iter(windows), None)


def row_mask_problem(model) -> str | None:
    """Why `model` cannot take the per-row 4-D masks built here (None if it can).

    Rows of different lengths and the static layout put a query somewhere other than the last slots the cache
    returns, so the model must attend through the mask it is given and add nothing position-dependent of its own.
    """
    text = model.config.get_text_config()
    problem = mask_problem(text)
    if problem:
        return problem
    implementation = model.config._attn_implementation
    if implementation not in MASKED_ATTENTION:
        return f"attn_implementation={implementation!r} builds its own causal mask (load it with attn_implementation='sdpa')"
    if uses_alibi(text):
        return "its ALiBi position bias is built from a 2-D padding mask, which cannot say where each row's queries sit"
    problem = slot_position_problem(model)
    if problem:
        return f"{problem}, which is wrong for rows that end elsewhere and for a token tree's branches"
    for name, _ in own_causal_masks(model):
        return (
            f"its attention ({name}) applies a causal/local mask of its own, indexed from the last cached slot, "
            "which is wrong for rows that end elsewhere"
        )
    return None


def uses_alibi(text_config) -> bool:
    """Whether the model positions tokens by an ALiBi bias: Bloom's always, Falcon's with alibi=True, MPT's with
    attn_config.alibi."""
    attn_config = getattr(text_config, "attn_config", None)
    return (
        text_config.model_type == "bloom"
        or getattr(text_config, "alibi", False)
        or getattr(attn_config, "alibi", False)
    )


def slot_position_problem(model) -> str | None:
    """Why `model` places each fed token at the position after its cache's slots rather than where it is told (None
    if it does not): its forward takes no position_ids (BART-family and TrOCR decoders, RoFormer). `generate` then
    counts a padded row's padding as positions, as `generate` passes position_ids only to a forward that takes them.
    ALiBi models (Bloom, Falcon, MPT) place nothing: their bias is relative, and `row_mask_problem` and
    `masked_window_problem` say what they cannot take."""
    if uses_alibi(model.config.get_text_config()):
        return None
    if "position_ids" in inspect.signature(model.forward).parameters:
        return None
    return "its forward takes no position_ids and places fed tokens after its cache's slots"


def own_causal_masks(model) -> list[tuple[str, torch.Tensor]]:
    """(module name, mask) of every attention that applies a causal mask of its own: a 4-D bool buffer `bias`
    (GPT-Neo's, where a local layer's mask is banded)."""
    masks = []
    for name, module in model.named_modules():
        bias = getattr(module, "bias", None)
        if (
            isinstance(bias, torch.Tensor)
            and not isinstance(bias, nn.Parameter)
            and bias.dtype == torch.bool
            and bias.dim() == 4
        ):
            masks.append((name, bias))
    return masks


def masked_window_problem(model) -> str | None:
    """Why `model` cannot measure its attention windows or position bias over masked prompt tokens as `generate`
    does (None if it can): a window or bias the model applies itself counts the cache slots hybrid holds, which
    leave masked tokens out."""
    text = model.config.get_text_config()
    types, _ = attention_pattern(text)
    if getattr(getattr(text, "attn_config", None), "alibi", False):
        # MPT's ALiBi is an arange over the key slots; Bloom's and Falcon's count only unmasked tokens (cumsum).
        return "its ALiBi bias counts key slots, so a masked slot between two tokens changes their distance"
    problem = row_mask_problem(model)
    if "sliding_attention" in types and problem is not None:
        return f"its sliding-window layers cannot take hybrid's masks: {problem}"
    for name, bias in own_causal_masks(model):
        if not bool(bias[..., -1, :].all()):  # a causal mask's last query sees every key; a local one does not
            return f"its attention ({name}) applies a local window of its own, over the slots hybrid's cache holds"
    return None


def mask_problem(text_config) -> str | None:
    """Why the model's attention fails on any forward that takes a mask (None if it does not): then only unmasked
    forwards run, a prefill and one token at a time, as `model.generate` runs it at batch 1.

    Multi-head latent attention expands its cached latent to num_attention_heads heads and then repeats them
    num_attention_heads // num_key_value_heads times more, which fits the queries only when the two head counts are
    equal (as in every released checkpoint); without a mask, SDPA's grouped-query kernel takes the heads as they are."""
    # Read with getattr: BLT's config keeps its head counts in sub-configs, none at the top.
    heads = getattr(text_config, "num_attention_heads", None)
    kv_heads = getattr(text_config, "num_key_value_heads", None)
    if getattr(text_config, "kv_lora_rank", None) and heads and kv_heads and kv_heads != heads:
        return (
            f"its config has num_key_value_heads={kv_heads} but its latent attention (kv_lora_rank) expands keys and "
            f"values to num_attention_heads={heads} heads, which transformers' attention repeats "
            f"{heads // kv_heads}x more on every forward with a mask (a verify of drafted tokens, rows of different "
            f"lengths): set num_key_value_heads={heads}"
        )
    return None


# Recurrent models whose config names no layer types: the names transformers' own generate checks
# (`_supports_default_dynamic_cache`); from 5.25 no model sets `_is_stateful`.
_RECURRENT_NAMES = ("rwkv", "xlstm")


def keeps_recurrent_state(model) -> bool:
    """Whether `model` keeps state that cropping cannot roll back: a stateful model (Mamba, RWKV, xLSTM), or
    linear-attention / Mamba / recurrent layers among its layer types."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    return (
        getattr(model, "_is_stateful", False)  # transformers < 5.25
        or any("linear" in t or "mamba" in t or "recurrent" in t for t in types)
        or any(name in type(model).__name__.lower() for name in _RECURRENT_NAMES)
    )


def cache_feed_problem(model, width: int) -> str | None:
    """Why `model`'s forward cannot take `width` new tokens on top of the cache it is passed, step after step, as
    hybrid feeds them (None if it can): a forward that stores nothing in that cache (Reformer's), keeps state in a
    cache of its own around it (BLT's), or fails, or scores another number of positions than it was fed, when tokens
    are cached already (XLM's takes the whole sequence every step and slices off what its cache holds, ProphetNet's
    asserts one token at a time). The signature cannot tell, so forwards of 2 tokens and then twice `width` tell,
    once per kind of model and width (`verifiers.verdicts.probed`): without this the first steps, or the cost
    measurement before them, would fail inside the model."""
    return probed(model, _feed_problem, width)


def cache_feed_refusal(model, several: bool, role: str = "verifier") -> str | None:
    """Why `model` cannot serve as `role` by feeding its cache `several` tokens a forward (a verify, a drafter's
    catch-up) or one (a verifier without drafts, as `generate`), as a refusal naming the fix; None if it can."""
    problem = cache_feed_problem(model, SEVERAL_TOKENS if several else 1)
    if problem is None:
        return None
    if several and role == "verifier" and cache_feed_problem(model, 1) is None:
        return (
            f"{type(model).__name__} cannot verify drafted tokens, which a verify feeds (the pending token and its "
            f"drafts) in one forward on top of the cache: {problem}. Pass drafter=None (one token per forward, as "
            "model.generate decodes), or decode with model.generate"
        )
    return (
        f"{type(model).__name__} cannot be a {role}, whose forward must take each step's new tokens on top of the "
        f"cache of the ones before: {problem}. Decode it with model.generate"
    )


def _feed_problem(model, width: int) -> str | None:
    tokens, _ = probe_tokens(model, 2 + 2 * width)
    # Position ids as the verifier passes them: some forwards cannot derive their own (XMOD's without a pad id)
    positions = torch.arange(tokens.shape[1], device=model.device)[None]
    cache = DynamicCache(config=model.config)
    for start, end in ((0, 2), (2, 2 + width), (2 + width, 2 + 2 * width)):
        fed = f"{end - start} token{'s' if end - start > 1 else ''}" + (f" after {start} cached ones" if start else "")
        try:
            # Through `forward`, past hooks on the model itself: they watch decoding's forwards, and this is none.
            out = model.forward(
                input_ids=tokens[:, start:end], position_ids=positions[:, start:end], cache=cache, use_cache=True
            )
        except (MemoryError, torch.OutOfMemoryError):  # this machine's limit, not the model's
            raise
        except Exception as error:
            reason = (str(error).strip().splitlines() or [""])[0]
            return f"its forward fails when fed {fed} ({type(error).__name__}: {reason})"
        returned = getattr(out, "cache", None)
        if returned is not None and returned is not cache:
            return (
                f"its forward keeps state in a cache of its own ({type(returned).__name__}) around the one it is "
                "passed, which a forward through hybrid's cache would lose"
            )
        stores = storing_layers(cache, model.config.get_text_config())
        if not all(getattr(layer, "is_initialized", True) for layer in stores):  # recurrent layers: no flag
            return (
                "its forward did not store its keys/values in the cache hybrid passed it (cache=...): such a model "
                "recomputes the whole sequence every step"
            )
        if out.logits.shape[1] != end - start:
            return f"its forward, fed {fed}, returns scores for {out.logits.shape[1]} of them"
    return None


def learned_position_limit(model) -> int | None:
    """Positions the model can embed when it has a learned position table for its text (GPT-2's wpe, OPT's
    embed_positions), else None: rotary and ALiBi models have no table and, like `model.generate`, run past
    max_position_embeddings."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    tokens = model.get_input_embeddings()
    # An image or audio encoder inside the model (GIT's, Phi-4-multimodal's) has a table of its own patches' or
    # frames' positions, which no text token is placed by.
    towers = [
        name + "."
        for name, module in model.named_modules()
        if name and isinstance(module, PreTrainedModel) and all(m is not tokens for m in module.modules())
    ]
    sizes = []
    for name, module in model.named_modules():
        if name.startswith(tuple(towers)):
            continue
        if isinstance(module, nn.Embedding) and module is not tokens:
            size = module.num_embeddings - getattr(module, "offset", 0)  # OPT keeps two extra rows
            if size == context or "pos" in name.rsplit(".", 1)[-1]:
                sizes.append(size)
    return min(sizes) if sizes else None


def storing_layers(cache, text_config) -> list:
    """The layers of `cache` a forward stores keys and values in: all but those transformers marks as storing none
    (KV-shared and attention-free layers)."""
    types, _ = get_layer_types_and_kwargs(text_config)
    return [layer for i, layer in enumerate(cache.layers) if i >= len(types) or types[i] != "dummy"]


def cache_layer_sources(text_config) -> list[int]:
    """The model layer whose keys/values each layer of its cache holds: one cache layer per model layer, then for a
    looped model (Dory, `recurrent_kv_cache_mode="per_loop"`) one per recurrent layer and loop after the first, in
    the order the model appends them to a cache that has one layer per model layer."""
    layers = list(range(text_config.num_hidden_layers))
    loops = getattr(text_config, "n_recurrent_loops", 1)
    if loops == 1 or not text_config.n_recurrent_layers:
        return layers
    name = type(text_config).__name__
    if text_config.recurrent_kv_cache_mode != "per_loop":
        raise ValueError(
            f"{name} has recurrent_kv_cache_mode={text_config.recurrent_kv_cache_mode!r}: its earlier loops read each "
            "layer's cached tensors directly, not through Cache.update, so they would read all of hybrid's preallocated "
            "slots. hybrid serves recurrent_kv_cache_mode='per_loop' (each loop caches its own keys/values); use "
            "model.generate for this model"
        )
    recurrent = layers[text_config.n_input_layers : text_config.n_input_layers + text_config.n_recurrent_layers]
    return layers + recurrent * (loops - 1)


def cache_fingerprint(model) -> dict:
    """What a cache's shapes depend on: a cache built for a model with another fingerprint cannot serve it.

    "layers" holds (heads, key width, value width) per cache layer, read from each layer's own config (head sizes may
    differ by layer, as in Gemma 4). Multi-head latent attention (DeepSeek-V2 and its kin, `kv_lora_rank`) caches
    one head: the compressed latent as keys, the shared rotary key as values."""
    text = model.config.get_text_config()
    layers = []
    for source in cache_layer_sources(text):
        layer = text.per_layer_config[source]
        if getattr(layer, "kv_lora_rank", None):
            layers.append((1, layer.kv_lora_rank, layer.qk_rope_head_dim))
            continue
        heads = getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
        layers.append((heads, head_dim, head_dim))
    return {"architecture": type(model).__name__, "layers": layers}


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for size in shape:
        n *= size
    return n * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else n * 8


def bytes_per_row(model, capacity: int, hidden_width: int = 0) -> int:
    """Cache bytes one row needs: keys and values of every layer plus the kept hidden states."""
    layers = cache_fingerprint(model)["layers"]
    per_token = sum(heads * (key + value) for heads, key, value in layers) + hidden_width
    return shape_bytes((capacity, per_token), model.dtype)


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory where the cache goes: CUDA's free bytes, or the OS's MemAvailable for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(model, batch_size: int, capacity: int, hidden_width: int = 0) -> None:
    """Raise `CacheMemoryError` naming the batch size that fits when `batch_size` rows cannot be cached."""
    free = free_memory_bytes(torch.device(model.device))
    per_row = bytes_per_row(model, capacity, hidden_width)
    if free is None or batch_size * per_row <= free:
        return
    fits = free // per_row
    raise CacheMemoryError(
        f"a batch of {batch_size} rows of up to {capacity} tokens needs {batch_size * per_row / 2**30:.2f} GiB of "
        f"cache ({per_row / 2**20:.1f} MiB per row) but {free / 2**30:.2f} GiB is free on {model.device}: "
        + (f"pass at most {fits} rows per call" if fits else "even one row does not fit; lower max_new_tokens")
        + " (or free memory)"
    )


def foreign_cache_reason(model, cache) -> str | None:
    """Why `cache` (a transformers Cache) cannot have been built for `model`, or None if its shapes fit."""
    want = cache_fingerprint(model)
    name, shapes = want["architecture"], want["layers"]
    layers = getattr(cache, "layers", [])
    if layers and len(layers) != len(shapes):
        return f"it has {len(layers)} layers, {name} has {len(shapes)}"
    for i, (layer, shape) in enumerate(zip(layers, shapes)):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4 and keys.numel():
            held = (keys.shape[1], keys.shape[-1], values.shape[-1])
            if held != shape:
                return f"its layer {i} holds {_heads(*held)}, {name} has {_heads(*shape)}"
    return None


def _heads(heads: int, key_width: int, value_width: int) -> str:
    if key_width == value_width:
        return f"{heads} key/value heads of size {key_width}"
    return f"{heads} key/value heads of key size {key_width} and value size {value_width}"
