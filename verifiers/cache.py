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

**Recurrent and convolution states** (linear-attention, state-space and short-convolution layers) are kept per row
beside the keys and values, and a verify records the state after each fed token so that any accepted prefix is kept
without running it again (`verifiers.state_layers`). A model that keeps its state in a structure of its own (RWKV,
xLSTM) has no layers here: its state is kept whole, and a verify is rolled back by snapshot and replay
(`verifiers.own_state`). Such models verify chains, not trees.

**Static shapes** (`static=True`, `cache_implementation="static"`): every forward reads all `capacity`
slots through the mask and writes through an index tensor, so a forward of q tokens has the same shapes
at every step and a compiled forward (CUDA graphs) replays instead of re-tracing; the buffers never grow.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from verifiers.cache_layers import COMPRESSED, LAYER_TYPES, STATE_ONLY, attention_pattern, cache_layer_sources
from verifiers.compressed import CompressedEntries
from verifiers.indexed import PromptLayout
from verifiers.memory import CacheMemoryError, check_fits, shape_bytes
from verifiers.own_state import OwnStates, state_format
from verifiers.state_layers import RowStates, layer_states

HIDDEN = "hidden"  # the side buffer of the verifier's kept hidden states


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


class _IndexedLayer(_RowLayer):
    """A layer of indexed attention (DeepSeek-V3.2's): keys/values, and its indexer's keys [batch, capacity, width]
    in the same slots (`update_indexer`), which the indexer scores to pick what each query attends to."""

    def __init__(self, owner: SharedCache):
        super().__init__(owner)
        self.indexer_keys: torch.Tensor | None = None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        if self.indexer_keys is None:
            rows, _, width = indexer_key_states.shape
            shape = (rows, self.owner.capacity, width)
            self.indexer_keys = self.owner.allocate(shape, indexer_key_states.dtype, indexer_key_states.device)
        self.owner.write(self.indexer_keys, indexer_key_states, dim=1)
        return self.indexer_keys[:, : self.owner.end]

    @property
    def indexer_position_ids(self) -> torch.Tensor | None:
        """The positions of the slots before the forward in flight ([3, rows, end - q], slot p at position p): the
        model appends the fed tokens' positions, which are the last slots' only where rows are aligned, as a model
        that reads them asks (`support.row_mask_problem`)."""
        self.owner.reads_indexer_positions = True
        if not any(self.owner._forward_start):
            return None
        rows, q = self.owner._write_index.shape
        positions = torch.arange(self.owner.end - q, device=self.owner.device)
        return positions.expand(3, rows, -1)

    @indexer_position_ids.setter
    def indexer_position_ids(self, value) -> None:
        pass  # the slots' positions are their indices: nothing to keep

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[indices.to(self.indexer_keys.device)]


class _CompressedLayer(_RowLayer, CompressedEntries):
    """A DeepSeek-V4 layer: keys/values in slots for its sliding window, and its compressor's state
    (`verifiers.compressed`)."""

    def __init__(self, owner: SharedCache, compress_rate: int):
        _RowLayer.__init__(self, owner)
        CompressedEntries.__init__(self, compress_rate)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.select_compressed(indices)


class _StateLayer(RowStates):
    """A layer that keeps only recurrent / convolution states (linear attention, Mamba, short convolution)."""

    @property
    def is_initialized(self) -> bool:
        return self.holds_states


class _HybridLayer(_RowLayer, RowStates):
    """A layer that keeps both: attention keys/values in slots and recurrent / convolution states (Falcon-H1's)."""

    def __init__(self, owner: SharedCache, number_of_states: int):
        _RowLayer.__init__(self, owner)
        RowStates.__init__(self, number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # As transformers' hybrid layer tells them apart: keys and values come positionally, states by keyword.
        if args:
            _RowLayer.lazy_initialization(self, *args)
        else:
            RowStates.lazy_initialization(self, **kwargs)


def _cache_layer(owner: SharedCache, text_config, kind: str, states: int, attention: bool):
    """The cache layer for a model layer of `kind` (as transformers names its cache layer) with `states`
    recurrent/convolution state pairs and, or, attention."""
    if kind == "indexed_attention":
        return _IndexedLayer(owner)
    if kind in COMPRESSED:
        return _CompressedLayer(owner, text_config.compress_rates[kind])
    if not states:
        return _RowLayer(owner)
    return _HybridLayer(owner, states) if attention else _StateLayer(states)


class SharedCache(Cache):
    """The verifier's keys/values for every row, plus side buffers: its kept hidden states and a drafter's state.

    Args:
        model: the verifier (its config gives the layers and attention pattern).
        batch_size: rows.
        capacity: slots per row, i.e. the longest sequence (prompt + new tokens + a draft) it will hold.
            Buffers are allocated once at this size; a longer sequence grows them (a copy), never per step.
        hidden_width: width of the kept hidden states per token (0: none kept).
        static: the static-shape layout (module docstring): attention reads every slot, capacity is final.
        verify_width: the widest forward after the prefill, whose recurrent states are recorded per fed token
            (`verifiers.state_layers`): counted in the memory check.
    """

    def __init__(
        self,
        model,
        batch_size: int,
        capacity: int,
        hidden_width: int = 0,
        static: bool = False,
        windows_by_mask: bool = False,
        verify_width: int = 1,
    ):
        text = model.config.get_text_config()
        self.windows_by_mask = windows_by_mask
        self.sources = cache_layer_sources(text)
        self.layer_types, self.window, self.chunk = attention_pattern(text)
        states = layer_states(text)  # a looped model's extra cache layers are of their source layer's kind
        kinds = get_layer_types_and_kwargs(text)[0]
        own = state_format(model)
        # A model with a state structure of its own is never passed this cache: it holds that state instead of layers
        self.own_states = None if own is None else OwnStates(model, own)
        layers = (
            []
            if own is not None
            else [_cache_layer(self, text, kinds[source], *states[source]) for source in self.sources]
        )
        super().__init__(layers=layers)
        self.state_layers = [layer for layer in self.layers if isinstance(layer, RowStates)]
        # Rows' lengths when the states' recording began, and the tokens fed since (None: nothing to settle)
        self._record_start: list[int] | None = None
        self._fed_since = 0
        self._recording = False  # whether the forwards since `_record_start` recorded their states
        # Whether a rollback may reach back past the last forward (a drafter's, after its one-token forwards): then
        # every forward records and the states settle only after a rollback. A verifier rolls back within its last
        # forward, so a forward of one token records nothing and runs as `generate`'s step does.
        self.rollback_across_forwards = False
        self.capacity = max(int(capacity), 1)
        self.static = static
        self.lengths = [0] * batch_size  # tokens cached per row
        self.device, self.dtype, self.config = model.device, model.dtype, model.config
        check_fits(model, batch_size, self.capacity, hidden_width, verify_width)
        self.side: dict[str, torch.Tensor] = {}  # name -> [rows, capacity, *per_token], see `side_buffer`
        self.side_lengths: dict[str, list[int]] = {}  # name -> its valid tokens per row
        if hidden_width:  # where the drafter reads them: by the head (the last GPU under device_map="auto")
            self.side_buffer(HIDDEN, (hidden_width,), model.dtype, model.get_output_embeddings().weight.device)
        self._write_index: torch.Tensor | None = None  # [rows, q] slots of the forward in flight
        self._write_start: int | None = None  # their common first slot, when every row starts at the same one
        self._tree: tuple[torch.Tensor, torch.Tensor] | None = None  # the fed token tree's depths and visibility
        self._forward_start: list[int] = []  # each row's length before the last forward
        self.holes: torch.Tensor | None = None  # [rows, P + 1] masked prompt tokens before each slot (`mark_masked`)
        self.prompt_layout: PromptLayout | None = None  # the prompts as `generate` holds them, for an indexer
        # The prefill through the model's own mask even over holes (`Verifier.prefill_rows`: a model whose own mask
        # ignores its window attends over a holed prompt in full under `generate`).
        self.prefill_by_own_mask = False
        self.end = 0  # slots attention reads this forward: max(lengths) + q
        self.reads_indexer_positions = False  # whether the model reads the indexer's positions from the cache

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

    def grow(self, buffer: torch.Tensor, dim: int, size: int | None = None) -> torch.Tensor:
        """`buffer` with `dim` widened to `size` (default: the current capacity), contents kept."""
        shape = list(buffer.shape)
        shape[dim] = self.capacity if size is None else size
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
            self._resize(max(slots, 2 * self.capacity))

    def _resize(self, capacity: int) -> None:
        """Widen every buffer to `capacity` slots, contents kept."""
        self.capacity = capacity
        for layer in self._kv_layers():  # layers not yet initialised are allocated at the new capacity
            if layer.is_initialized:
                layer.keys, layer.values = self.grow(layer.keys, 2), self.grow(layer.values, 2)
            if getattr(layer, "indexer_keys", None) is not None:
                layer.indexer_keys = self.grow(layer.indexer_keys, 1)
            if isinstance(layer, CompressedEntries):
                layer.resize_compressed()
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
        prefill = not any(self.lengths)
        if self.keeps_states:
            self._begin_states(q, prefill, tree is not None)
        starts = torch.tensor(self.lengths, device=self.device)
        self._forward_start = list(self.lengths)
        self._write_index = starts[:, None] + torch.arange(q, device=self.device)
        self._tree = None if tree is None else (tree[0].to(self.device), tree[1].to(self.device))
        # Static shapes write through the index tensor even when rows are aligned: a slice start would be a
        # Python int that changes every step, i.e. a new graph. The prefill runs eagerly either way, and as in
        # `generate` through the model's own mask over the prompt's slots alone (`needs_mask`).
        self._write_start = self.lengths[0] if len(set(self.lengths)) == 1 and (prefill or not self.static) else None
        self.end = self.capacity if self.static and not prefill else max(self.lengths) + q
        return self._write_index if tree is None else starts[:, None] + self._tree[0]

    def mark_masked(self, masks: list[torch.Tensor | None], lengths: list[int] | None = None) -> None:
        """Record each row's prompt mask (1-D, 0 for a masked token; None: no mask) so that sliding windows and
        attention chunks count masked tokens as `generate` does. Only holes after a row's first unmasked token matter
        (leading ones shift every position alike), and only on sliding and chunked layers: otherwise nothing is kept
        and nothing changes. `lengths` (each row's unmasked prompt tokens) lays out, for an indexer, the prompts as
        `generate` holds them, padding included (`verifiers.indexed`)."""
        if lengths is not None:
            self.prompt_layout = PromptLayout.of(masks, lengths)
        holes = [None if mask is None else prompt_holes(mask) for mask in masks]
        windowed = {"sliding_attention", "chunked_attention"} & set(self.layer_types)
        if not windowed or not any(h is not None and bool(h[-1]) for h in holes):
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
        if self.own_states is not None:  # an attention-free forward that takes no mask (RWKV ignores one, warning)
            return False
        started = any(self._forward_start)  # not the prefill
        if not self.aligned or self._tree is not None:
            return True
        if self.holes is not None and (started or not self.prefill_by_own_mask):
            return True
        if self.chunk is not None and started and self.end > self.chunk:  # the chunks as the masks here lay them
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
        for kind in set(self.layer_types) & set(LAYER_TYPES):
            seen = visible
            if kind == "sliding_attention":
                seen = visible & (key_pos > query_pos - self.window)
            elif kind == "chunked_attention":
                seen = visible & (key_pos // self.chunk == query_pos // self.chunk)
            masks[kind] = torch.zeros(seen.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~seen, torch.finfo(self.dtype).min
            )[:, None]
        if not masks:  # no attention layer (a state-space model): nothing to mask, a fed token is never padding
            return None
        if len(masks) == 1:  # the model maps it to its attention layers; its recurrent layers take no 4-D mask
            return next(iter(masks.values()))
        if self.state_layers:  # a fed token is never padding: nothing for the recurrent / convolution layers to mask
            masks |= dict.fromkeys(STATE_ONLY)
        return masks

    def commit(self, q: int, hidden: torch.Tensor | None = None) -> None:
        """After the forward: every row now holds its q fed tokens (rollback drops the rejected ones)."""
        if hidden is not None and HIDDEN in self.side:
            self.write(self.side[HIDDEN], hidden, dim=1)
        self.lengths = [n + q for n in self.lengths]
        if HIDDEN in self.side:
            self.side_lengths[HIDDEN] = list(self.lengths)
        self._write_index, self._write_start, self._tree = None, None, None

    # -- rollback and finished rows ------------------------------------------------------------------

    @property
    def keeps_states(self) -> bool:
        """Whether rows hold recurrent or convolution state, in state layers or a structure of the model's own."""
        return bool(self.state_layers) or self.own_states is not None

    def _begin_states(self, q: int, prefill: bool, tree: bool) -> None:
        """Before a forward of q tokens: settle what earlier forwards left (`settle_states`), and have the state
        layers record the state after each fed token where a rollback may undo it."""
        if tree:
            raise ValueError("a model with recurrent or convolution states verifies chains, not token trees")
        rolled_back = self._record_start is not None and any(
            n < start + self._fed_since for n, start in zip(self.lengths, self._record_start)
        )
        record = not prefill and (q > 1 or self.rollback_across_forwards)
        if not self.rollback_across_forwards or rolled_back or record != self._recording:
            self.settle_states()
        if self._record_start is None:
            self._record_start, self._fed_since, self._recording = list(self.lengths), 0, record
        if record:
            for layer in self.state_layers:
                layer.record(q)
            if self.own_states is not None:
                self.own_states.record()
        self._fed_since += q

    @torch.inference_mode()
    def settle_states(self) -> None:
        """Keep, in every state layer, each row's state after the tokens it kept of the forwards since the last
        settling (their recorded states, `verifiers.state_layers`). Runs before a forward and before rows are
        selected or read, once the accepted lengths are final."""
        if self._record_start is None:
            return
        fed, recorded = self._fed_since, self._recording
        kept = [n - start for n, start in zip(self.lengths, self._record_start)]
        self._record_start, self._fed_since, self._recording = None, 0, False
        if any(not 0 <= n <= fed for n in kept) or (not recorded and any(n != fed for n in kept)):
            raise RuntimeError(
                f"rows of recurrent state kept {kept} of the {fed} tokens fed since their states were last settled, "
                f"{'recorded' if recorded else 'unrecorded'}: such a rollback cannot be undone"
            )
        if recorded:
            for layer in self.state_layers:
                layer.settle(kept)
            if self.own_states is not None:
                self.own_states.settle(kept)

    def rollback_floor(self, row: int) -> int:
        """The shortest length row `row` can be rolled back to: 0 for keys and values alone; with recurrent states,
        the length at which they were last settled, unless the forwards since recorded them."""
        if not self.keeps_states:
            return 0
        return self._record_start[row] if self._recording else self.lengths[row]

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
            if self.keeps_states and list(offsets) != list(range(len(offsets))):
                raise ValueError(f"row {b} keeps fed tokens {offsets}: recurrent states keep a prefix only")
            if any(not 0 <= o < self.lengths[b] - start for o in offsets) or sorted(set(offsets)) != list(offsets):
                raise ValueError(f"row {b} cannot keep fed tokens {offsets} of the {self.lengths[b] - start} it holds")
            moved = [(start + o, start + i) for i, o in enumerate(offsets) if o != i]
            if moved:
                src = torch.tensor([s for s, _ in moved], device=self.device)
                dst = torch.tensor([d for _, d in moved], device=self.device)
                for layer in self._kv_layers():
                    if layer.is_initialized:
                        for buffer in (layer.keys, layer.values):
                            buffer[b, :, dst.to(buffer.device)] = buffer[b, :, src.to(buffer.device)]
                    if getattr(layer, "indexer_keys", None) is not None:
                        keys = layer.indexer_keys
                        keys[b, dst.to(keys.device)] = keys[b, src.to(keys.device)]
                for buffer in self.side.values():
                    buffer[b, dst.to(buffer.device)] = buffer[b, src.to(buffer.device)]
        self.rollback([n - start - len(offsets) for n, start, offsets in zip(self.lengths, self._forward_start, kept)])

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order), e.g. drop finished ones so they stop costing work."""
        self.settle_states()
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self._kv_layers():
            layer.batch_select_indices(index)
        for layer in self.state_layers:
            layer.select(index)
        if self.own_states is not None:
            self.own_states.select(index)
        self.side = {name: b[index.to(b.device)] for name, b in self.side.items()}
        self.lengths = [self.lengths[r] for r in rows]
        if self.holes is not None:
            self.holes = self.holes[index]
        if self.prompt_layout is not None:
            self.prompt_layout = self.prompt_layout.select(rows)
        self.side_lengths = {name: [valid[r] for r in rows] for name, valid in self.side_lengths.items()}
        if self.static:  # the selected rows are new buffers: fixed addresses again
            for buffer in self.buffers():
                torch._dynamo.mark_static_address(buffer)

    def append_rows(self, other: SharedCache) -> None:
        """Append the rows of `other`, a cache built for the same model, after this one's (prefills of
        different prompt lengths, run apart so that no padding enters a recurrent state)."""
        if self.holes is not None or other.holes is not None:
            raise ValueError("only caches without masked prompt tokens are appended")
        for cache in (self, other):  # prompts of other lengths may have grown one of them
            if cache.capacity < max(self.capacity, other.capacity):
                cache._resize(max(self.capacity, other.capacity))
        self.settle_states()
        other.settle_states()
        for mine, theirs in zip(self.layers, other.layers):
            if isinstance(mine, _RowLayer) and mine.is_initialized:
                mine.keys, mine.values = torch.cat([mine.keys, theirs.keys]), torch.cat([mine.values, theirs.values])
            if getattr(mine, "indexer_keys", None) is not None:
                mine.indexer_keys = torch.cat([mine.indexer_keys, theirs.indexer_keys])
            if isinstance(mine, RowStates):
                mine.append_rows(theirs)
        if self.own_states is not None:
            self.own_states.append_rows(other.own_states)
        self.side = {name: torch.cat([buffer, other.side[name]]) for name, buffer in self.side.items()}
        self.side_lengths = {name: valid + other.side_lengths[name] for name, valid in self.side_lengths.items()}
        self.lengths = self.lengths + other.lengths
        if self.prompt_layout is not None:
            self.prompt_layout = self.prompt_layout.join(other.prompt_layout)

    def buffers(self) -> list[torch.Tensor]:
        """Every allocated tensor: keys and values per layer, then the side buffers."""
        kv = [t for layer in self._kv_layers() if layer.is_initialized for t in (layer.keys, layer.values)]
        indexer = [
            layer.indexer_keys for layer in self._kv_layers() if getattr(layer, "indexer_keys", None) is not None
        ]
        return kv + indexer + list(self.side.values())

    def _kv_layers(self) -> list[_RowLayer]:
        """The layers that keep keys and values in slots."""
        return [layer for layer in self.layers if isinstance(layer, _RowLayer)]

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

    def generate_cache(self, row: int = 0):
        """What `model.generate` returns as `out.cache` for row `row`: a `DynamicCache` (`to_dynamic`), or for a
        model with a state structure of its own that structure (RWKV's state list, an xLSTMCache)."""
        if self.own_states is None:
            return self.to_dynamic(row)
        self.settle_states()
        return self.own_states.exported(row, self.lengths[row])

    def to_dynamic(self, row: int = 0):
        """A transformers `DynamicCache` holding row `row`'s cached tokens, to continue with `model.generate`."""
        if self.own_states is not None:
            raise ValueError(
                f"{type(self.own_states.model).__name__} keeps its state in a structure of its own, which no "
                "DynamicCache holds: `generate_cache` returns it as model.generate does"
            )
        self.settle_states()
        cache = DynamicCache(config=self.config)  # as `generate` builds it (sliding layers keep their window)
        # A looped model's extra layers, as it appends them to a cache of one layer per model layer
        cache.layers += [copy.deepcopy(cache.layers[source]) for source in self.sources[len(cache.layers) :]]
        n = self.lengths[row]
        for i, layer in enumerate(self.layers):
            if isinstance(layer, RowStates):
                layer.copy_row_into(cache.layers[i], row)
                cache.layers[i].cumulative_length_linear.fill_(n)
            # A layer that stores nothing (KV sharing) is skipped: neither does generate's
            if isinstance(layer, _RowLayer) and layer.is_initialized:
                cache.update(layer.keys[row : row + 1, :, :n].clone(), layer.values[row : row + 1, :, :n].clone(), i)
            if getattr(layer, "indexer_keys", None) is not None:
                cache.update_indexer(layer.indexer_keys[row : row + 1, :n].clone(), i)
            if isinstance(layer, CompressedEntries):
                layer.export_compressed(cache.layers[i], row, n)
        if self.reads_indexer_positions:  # kept on the first indexed layer, as the model keeps them
            first = cache.layers[self.layer_types.index("indexed_attention")]
            first.indexer_position_ids = torch.arange(n, device=self.device).expand(3, 1, n)
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


def holed_rows(masks: list[torch.Tensor | None]) -> list[int]:
    """The rows whose prompt mask masks a token after the row's first unmasked one."""
    return [b for b, mask in enumerate(masks) if mask is not None and bool(prompt_holes(mask)[-1])]
