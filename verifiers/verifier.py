"""The AR verifier: one prefill, then k drafted tokens + the bonus position scored in ONE forward.

The cache (`verifiers.cache.SharedCache`) holds every committed token except the newest one (the
"pending" token the verifier has just chosen and not yet run). A verify step feeds
`[pending, d_1 .. d_k]` for every row, which yields the verifier's distribution after each of them;
after acceptance, `keep_accepted` keeps each row's accepted tokens (a tree's path copied down to consecutive slots)
and forgets the rejected drafts by moving the row's length back. Nothing is recomputed. Whether a model can be a
verifier at all is `verifiers.support`'s to say, asked once as the Verifier is built.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from verifiers.cache import SharedCache, holed_rows, tree_layout
from verifiers.cache_layers import storing_layers
from verifiers.indexed import choosing_as_generate, indexers
from verifiers.kernels import chosen_kernels, cpu_linears, forget_changed_weights, prepare_linears
from verifiers.own_state import state_format
from verifiers.positions import positions_room, rope_switches
from verifiers.probes import LOGITS_DIFFER, relative_difference
from verifiers.step_inputs import rereads
from verifiers.support import check_masks, check_position_scale, check_support, keeps_states, learned_position_limit

STATIC_CAPACITY_STEP = 256  # static caches are sized in multiples of this many slots


class Verifier:
    """Wraps any `AutoModelForCausalLM` for draft verification, one row per sequence of a batch.

    Args:
        model: the verifier.
        hidden_layers: indices into the model's `hidden_states` tuple (0 = embeddings, i = output of
            layer i) whose states are kept for every cached token, concatenated on the last dim. A
            drafter that conditions on the verifier reads them through `hidden_states()`.
        static: the static-shape path (`cache_implementation="static"`): the cache's slots are all read through
            the mask and a verify of m tokens is padded to `static_width(m, max_width)`, so a verify step has
            one of a few shapes and a compiled `step_call` replays it (CUDA graphs) instead of re-tracing.
        max_width: the widest verify, 1 + the longest draft (static path).
        compile_config: a transformers `CompileConfig` to compile the verify step with (static path; None:
            eager), as `model.generate` compiles a static cache's decoding step; drafters compile their own
            static-shape forward with it through `compiled()`. The prefill always runs eagerly: its shape is
            the prompt's, so compiling it would re-trace per prompt.
        row_kernels: row count (fed tokens x rows) -> the kernel its plain float32 CPU linear products run, where
            the machine's cost table measured one faster than PyTorch's (`verifiers.kernels`,
            `verifiers.cost_table.cached_kernel_choice`); every other product runs PyTorch's own kernel.
        forward_costs: the machine's measured seconds of a forward feeding n tokens (`verifiers.cost_table
            .cached_kernel_choice`; empty: none cached). An eager verify is padded by one position per row where that
            forward costs PAD_MARGIN less (on some CPUs a weight-left product of 2 rows beats PyTorch's of 1).
    """

    def __init__(
        self,
        model,
        hidden_layers: tuple[int, ...] = (),
        role: str = "verifier",
        static: bool = False,
        max_width: int = 1,
        compile_config=None,
        row_kernels: dict[int, str] | None = None,
        forward_costs: dict[int, float] | None = None,
    ):
        # Raises, naming the fix, for a model that cannot serve so; a model that takes no per-row masks (the reason
        # kept here) runs one row per forward, chains only.
        self.row_mask_problem = check_support(
            model,
            role=role,
            max_width=max_width,
            static=static,
            hidden_layers=hidden_layers,
            compiled=compile_config is not None,
        )
        self.batches = self.row_mask_problem is None
        self.keeps_states = keeps_states(model)
        # Indexed attention's indexers, which choose within a verify as `generate`'s steps do (`verifiers.indexed`)
        self.indexers = indexers(model)
        self.role = role
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        text = self.text_config = model.config.get_text_config()
        self.hidden_width = len(self.hidden_layers) * text.hidden_size if self.hidden_layers else 0
        self._supports_logits_to_keep = model._supports_logits_to_keep()
        # A learned position table ends; past it `generate` fails too, so `hybrid.generate` refuses such a call up
        # front and a real token's position is never clamped here.
        self.max_positions = learned_position_limit(model)
        # Rotary embeddings whose frequencies follow a forward's last position (`verifiers.positions`): every forward
        # keeps its positions on one side of their switches.
        self.rope_switches = rope_switches(model)
        # Positions at which the model's `generate` drops its cache and re-reads the sequence (`plan_rereads`).
        self.rereads: list[int] = []
        self.static = static
        self.max_width = max_width
        self.compile_config = compile_config
        self.step_call = model if compile_config is None else model.get_compiled_call(compile_config)
        # An eager forward runs each linear's product through the kernel measured fastest at its row count
        # (`verifiers.kernels`); a compiled step keeps the kernels it was traced with.
        self.linears = cpu_linears(model) if compile_config is None else []
        self.row_kernels = dict(row_kernels or {})
        self._kernels_in_place = False  # inside `kernels()`: each forward finds its kernels installed
        # The one-position padding is for eager forwards, whose kernels follow the row count; a model with a state
        # structure of its own would fold the padding into its state, and replay every verify to undo it.
        padded = compile_config is None and not static and state_format(model) is None
        self.forward_costs = dict(forward_costs or {}) if padded else {}
        self.cache: SharedCache | None = None

    def compiled(self, module):
        """`module` compiled as the verify step is (for a drafter's static-shape forward), or `module` itself."""
        if self.compile_config is None:
            return module
        config, call = getattr(module, "_hybrid_compiled", (None, None))
        if config != self.compile_config:
            config, call = self.compile_config, torch.compile(module, **self.compile_config.to_dict())
            module._hybrid_compiled = (config, call)  # a tuple, so not registered as a submodule
        return call

    @contextlib.contextmanager
    def kernels(self):
        """Within the block, the linears' chosen kernels stay installed (`verifiers.kernels.chosen_kernels`), so a
        forward does not install and remove a forward on each of the model's linears (milliseconds on a CPU) around
        itself. A call decodes within one such block; the model is as it was afterwards."""
        # Reordered copies of weights written through `.data` since, or no longer float32 (`model.half()`: freed).
        forget_changed_weights(self.model.modules())
        if not self.row_kernels or self._kernels_in_place:
            yield
            return
        prepare_linears(self.linears, set(self.row_kernels.values()))
        with chosen_kernels(self.linears, self.row_kernels):
            self._kernels_in_place = True
            try:
                yield
            finally:
                self._kernels_in_place = False

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    # -- a batch of rows ------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill_rows(
        self, rows: list[torch.Tensor], capacity: int, masks: list[torch.Tensor | None] | None = None
    ) -> torch.Tensor:
        """Run each prompt (1-D, its unmasked tokens); return float32 logits after each one's last token [rows, vocab].

        `capacity` bounds a row's length (prompt + new tokens + draft) so buffers are allocated once. `masks`: each
        row's prompt mask (1-D, 0 for the masked tokens `rows[b]` leaves out; None: none), for the windows that
        count them as `generate` does.
        """
        if len(rows) > 1 and not self.batches:
            raise ValueError(
                f"{type(self.model).__name__} takes no per-row masks ({self.row_mask_problem}): verify one row per call"
            )
        masks = [None] * len(rows) if masks is None else masks
        check_masks(self.model, masks)
        check_position_scale(self.model, masks, [row.shape[0] for row in rows], capacity)
        if self.static:  # calls of similar length share a capacity, hence their compiled graphs
            capacity = -(-capacity // STATIC_CAPACITY_STEP) * STATIC_CAPACITY_STEP
        if self.keeps_states and len({row.shape[0] for row in rows}) > 1:
            return self._prefill_by_length(rows, capacity, masks)
        logits = self._prefill(rows, capacity, masks, own_mask=False)
        holed = holed_rows(masks)
        if holed and self.cache.holes is not None:
            logits = self._prefill_as_generate(rows, capacity, masks, holed, logits)
        return logits

    def _prefill(self, rows, capacity: int, masks, own_mask: bool) -> torch.Tensor:
        """A fresh cache holding `rows`; the logits after each one's last token. `own_mask`: through the model's own
        mask even where a masked prompt token sits inside a sliding window."""
        self.cache = SharedCache(
            self.model,
            len(rows),
            capacity,
            self.hidden_width,
            static=self.static,
            windows_by_mask=self.batches,
            verify_width=self.max_width,
        )
        self.cache.mark_masked(masks, [row.shape[0] for row in rows])
        self.cache.prefill_by_own_mask = own_mask
        # A drafter rolls back past its one-token forwards (`SharedCache.rollback_across_forwards`)
        self.cache.rollback_across_forwards = self.role != "verifier"
        lengths = [row.shape[0] for row in rows]
        width = max(lengths)
        # Right-padded: a real token only sees earlier slots, so the padding needs no mask; its slots lie
        # past the row's length and the row's first verify overwrites them.
        tokens = torch.stack([torch.cat([row, row.new_zeros(width - row.shape[0])]) for row in rows])
        last = torch.tensor(lengths, device=tokens.device) - 1
        keep = torch.unique(last)
        keep = keep if self._supports_logits_to_keep else 0
        logits = self._forward(tokens, lengths, logits_to_keep=keep, prefill=True)
        if not all(layer.is_initialized for layer in storing_layers(self.cache, self.model.config.get_text_config())):
            raise ValueError(
                f"{type(self.model).__name__}'s forward did not store its keys/values in the cache hybrid passed it "
                "(cache=...): such a model recomputes the whole sequence every step, so a verify of drafted tokens "
                "would not see the committed ones. hybrid needs a model that uses a transformers Cache"
            )
        column = torch.searchsorted(keep, last) if self._supports_logits_to_keep else last
        self.cache.rollback([width - n for n in lengths])
        return logits[torch.arange(len(rows)), column]

    def _prefill_by_length(self, rows, capacity: int, masks) -> torch.Tensor:
        """Prompts of different lengths, each length's rows in a forward of their own: a right-padded forward would
        fold its padding into the recurrent states, which no rollback undoes. Each row is prefilled as `generate`
        prefills it alone; the caches are then joined in the rows' order."""
        by_length: dict[int, list[int]] = {}
        for b, row in enumerate(rows):
            by_length.setdefault(row.shape[0], []).append(b)
        groups = list(by_length.values())
        logits, cache = [], None
        for group in groups:
            logits.append(self._prefill([rows[b] for b in group], capacity, [masks[b] for b in group], own_mask=False))
            if cache is None:
                cache = self.cache
            else:
                cache.append_rows(self.cache)
        self.cache = cache
        order = [b for group in groups for b in group]  # the joined cache's row i holds row order[i]
        where = sorted(range(len(order)), key=order.__getitem__)
        self.cache.select_rows(where)
        return torch.cat(logits)[torch.tensor(where)]

    @torch.inference_mode()
    def _prefill_as_generate(self, rows, capacity: int, masks, holed: list[int], logits: torch.Tensor) -> torch.Tensor:
        """A prompt with a masked token inside a sliding window: `generate` counts the hole in the window of a model
        that applies its configured window (the masks built here do too), while a model whose own mask ignores that
        window (Moshi's) attends over the whole prompt in `generate`'s prefill. The holed rows' forward as `generate`
        runs it tells which; the prefill through the model's own mask is kept where it is the nearer."""
        reference = []
        for b in holed:
            mask = masks[b].to(rows[b].device).long()
            tokens = rows[b].new_full(mask.shape, int(rows[b][0]))  # a masked token's id changes nothing
            tokens[mask.bool()] = rows[b]
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as `generate` numbers them
            out = self.model(
                tokens[None],
                attention_mask=mask[None],
                position_ids=position_ids[None],
                cache=DynamicCache(config=self.model.config),
                use_cache=True,
            )
            reference.append(out.logits[0, -1].float())
        reference = torch.stack(reference)

        windowed = relative_difference(reference, logits[holed])
        if windowed <= LOGITS_DIFFER:
            return logits
        windowed_cache = self.cache
        own = self._prefill(rows, capacity, masks, own_mask=True)
        if relative_difference(reference, own[holed]) < windowed:
            return own
        self.cache = windowed_cache
        return logits

    @torch.inference_mode()
    def verify_rows(
        self, tokens: torch.Tensor, real: list[int] | None = None, parents: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Feed tokens [rows, m] after each row's cache; return float32 logits [rows, m, vocab]:
        [b, i] is the verifier's view after row b's fed token i and everything it continues. Row b's tokens past
        `real[b]` (default: m) are padding, whose outputs are never read and whose slots are dropped.

        parents: per row, the token tree its tokens[b, 1:] form (`verifiers.cache.tree_layout`; None: each row is a
        chain). Only a model that takes per-row masks (`takes_trees`) verifies trees."""
        real = [tokens.shape[1]] * tokens.shape[0] if real is None else real
        if parents is not None and not self.takes_trees:
            raise ValueError(f"{type(self.model).__name__} takes no tree masks ({self.row_mask_problem})")
        m = tokens.shape[1]
        width = self.padded_width(m, tokens.shape[0])
        tree = None if parents is None else tree_layout(parents, width, self.model.device)
        if width == m:
            return self._forward(tokens, real, logits_to_keep=0, call=self.step_call, tree=tree)
        # Padded with the last token: its slots lie past what any row keeps, so they are dropped at once.
        padded = torch.cat([tokens, tokens[:, -1:].expand(-1, width - m)], dim=1)
        logits = self._forward(padded, real, logits_to_keep=0, call=self.step_call, tree=tree)
        self.cache.rollback([width - m] * padded.shape[0])
        return logits[:, :m]

    @property
    def takes_trees(self) -> bool:
        """Whether a verify may feed token trees: they need the per-row masks only some models take, and a model with
        recurrent states verifies chains (a state per tree node would need the model's kernels to follow the tree), as
        does one with indexed attention (whose indexer `generate` runs over a chain, `verifiers.indexed`)."""
        return self.row_mask_problem is None and not self.keeps_states and not self.indexers

    def width_rule(self):
        """`padded_width` as a plain function of (m, rows) that holds no reference to this verifier or its model (a
        scheduler kept per model by weak reference keeps it: a bound method would keep the model alive)."""
        if self.static:
            max_width = self.max_width
            return lambda m, rows=1: static_width(m, max_width)
        costs = self.forward_costs
        return lambda m, rows=1: cheaper_width(m, rows, costs)

    def padded_width(self, m: int, rows: int = 1) -> int:
        """Positions per row a verify of m tokens in each of `rows` rows runs: on the static path the width it is
        padded to; else m, or m + 1 where the machine's forward of one more position per row is cheaper."""
        return static_width(m, self.max_width) if self.static else cheaper_width(m, rows, self.forward_costs)

    @property
    def max_padding(self) -> int:
        """The most positions `padded_width` adds to a verify of the widest draft (cache slots the rows need)."""
        return 1 if self.forward_costs else 0

    def rollback_rows(self, drop: list[int]) -> None:
        """Forget the last drop[b] cached tokens of row b (rejected drafts)."""
        self.cache.rollback(drop)

    @torch.inference_mode()
    def keep_accepted(self, kept: list[list[int]]) -> None:
        """After a verify, row b keeps its fed tokens kept[b] (increasing offsets into that verify: the pending token
        and the accepted drafts, a tree's accepted path) and forgets the rest (`SharedCache.keep`)."""
        self.cache.keep(kept)

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows` of the batch, in this order."""
        self.cache.select_rows(rows)

    def positions_room(self, row: int = 0) -> int | None:
        """How many tokens past its pending one a forward may feed for `row` (None: any number): where a rotary
        embedding switches frequencies by a forward's last position, the forward stays on one side of the switch,
        and a forward ends before a position at which `generate` re-reads the sequence."""
        position = self.length(row)
        rooms = [q - position - 1 for q in self.rereads if q > position]
        if self.rope_switches and (room := positions_room(self.rope_switches, position)) is not None:
            rooms.append(room)
        return min(rooms) if rooms else None

    def plan_rereads(self, prompt_len: int, max_length: int, masked: bool, rows: int) -> None:
        """Find where, for a prompt of `prompt_len` tokens decoded to `max_length`, the model's `generate` drops its
        cache and re-reads the sequence in one forward (`verifiers.step_inputs`), so that the engine re-reads there
        too (`reread`). Its hook counts the sequence with its padding, which rows decoded here do not share: a batch
        or a masked prompt that reaches such a position is refused."""
        self.rereads = rereads(self.model, prompt_len, max_length)
        if self.rereads and (rows > 1 or masked):
            raise ValueError(
                f"{type(self.model).__name__}.generate drops its cache and re-reads the whole sequence, padding "
                f"included, once it grows past {self.rereads[0]} tokens, which rows decoded here reach at other steps "
                f"than in model.generate: pass one unpadded prompt per call, or keep the prompt plus max_new_tokens "
                f"within {self.rereads[0]} tokens"
            )

    def rereads_at(self, row: int = 0) -> bool:
        """Whether `row`'s pending token sits where `generate` re-reads the sequence (`reread`)."""
        return self.length(row) in self.rereads

    @torch.inference_mode()
    def reread(self, sequence: torch.Tensor) -> None:
        """Do what `generate` does where the model's hook drops its cache: the committed sequence [1, n] (pending
        token last) is fed again in one forward on an emptied cache, whose last position decides the rotary
        frequencies of them all (LongRoPE's long factors, for Phi-3). The pending token's slot is then dropped: the
        step's verify feeds it, with its drafts, as any other step does."""
        if len(self.cache.lengths) != 1 or sequence.shape[1] != self.length(0) + 1:
            raise ValueError(f"a reread takes one row's whole sequence, got {tuple(sequence.shape)}")
        self.cache.rollback([self.length(0)])
        self._forward(
            sequence, [sequence.shape[1]], logits_to_keep=1 if self._supports_logits_to_keep else 0, prefill=True
        )
        self.cache.rollback([1])

    def length(self, row: int = 0) -> int:
        """Tokens cached for `row`: also the position id its next fed token gets."""
        return self.cache.lengths[row]

    def hidden_states(self, row: int = 0) -> torch.Tensor | None:
        """States of `hidden_layers` for row `row`'s cached tokens: [1, length(row), len(hidden_layers) * hidden]."""
        return None if self.cache is None else self.cache.hidden_states(row)

    def generate_cache(self, row: int = 0):
        """What `model.generate` returns as `out.cache` for `row` (`SharedCache.generate_cache`)."""
        return self.cache.generate_cache(row)

    # -- batch 1 ----------------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int) -> torch.Tensor:
        """One prompt [1, n] (its masked tokens, if any, marked 0 in `attention_mask`); logits after it [vocab]."""
        mask = None if attention_mask is None else attention_mask[0]
        tokens = input_ids[0] if mask is None else input_ids[0][mask.bool()]
        return self.prefill_rows([tokens], capacity, [mask])[0]

    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed `tokens` [1, m] after the cache; return float32 logits [m, vocab], row i = after tokens[:, :i+1]."""
        return self.verify_rows(tokens)[0]

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` cached tokens (rejected drafts)."""
        self.rollback_rows([num_tokens])

    def rollback_floor(self, row: int = 0) -> int:
        """The shortest length `row` can be rolled back to (`SharedCache.rollback_floor`): 0 for keys and values
        alone; a model with recurrent states reaches back only over the forwards since its states last settled."""
        return 0 if self.cache is None else self.cache.rollback_floor(row)

    # -- the forward --------------------------------------------------------------------------------------

    def _forward(
        self, input_ids: torch.Tensor, real: list[int], logits_to_keep, call=None, tree=None, prefill: bool = False
    ) -> torch.Tensor:
        """One forward of input_ids [rows, m] after each row's cache, of which row b's first real[b] are tokens
        (`prefill`: the prompts, one forward as in `generate`, wherever their positions reach)."""
        call = call or self.model
        compiled = call is not self.model
        m = input_ids.shape[1]
        position_ids = self.cache.begin(m, tree)
        if self.rope_switches:
            position_ids = self._within_switches(position_ids, real, check=not prefill)
        if self.max_positions is not None:
            last = max(int(row[:r].max()) for row, r in zip(position_ids, real))
            if last >= self.max_positions:
                raise ValueError(
                    f"position {last} is past the {self.max_positions} positions "
                    f"{type(self.model).__name__} embeds: shorten the prompt or max_new_tokens"
                )
            # Padding may reach past the table; its outputs are never read, so any position in range serves.
            position_ids = position_ids.clamp(max=self.max_positions - 1)
        # A chain in aligned rows (always at batch 1 on the dynamic path): the model's own causal mask is right, as
        # the cache ends at length + m. Uneven rows, static shapes and trees: per-row masks from the lengths.
        mask = self.cache.attention_mask(m) if self.cache.needs_mask else None
        extra = {"logits_to_keep": logits_to_keep} if self._supports_logits_to_keep else {}
        if compiled:  # the last step's outputs are consumed: CUDA graphs may overwrite them
            torch.compiler.cudagraph_mark_step_begin()
        # Every fed position reaches every dense product (and the head, keeping all logits): that is their row count.
        rows = input_ids.numel() if isinstance(logits_to_keep, int) and logits_to_keep == 0 else None
        own = self.cache.own_states
        # A model with a state structure of its own is fed that state (and takes no cache, positions or mask)
        inputs = (
            own.inputs(input_ids)
            if own is not None
            else dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=self.cache)
        )
        installed = self._kernels_in_place
        with (
            contextlib.nullcontext() if installed else chosen_kernels(self.linears, self.row_kernels, rows),
            choosing_as_generate(self.indexers, self.cache),
        ):
            out = call(
                **inputs,
                use_cache=True,
                # By index, so that only the kept layers' states are held: the others are freed layer by layer.
                output_hidden_states=list(self.hidden_layers) if self.hidden_layers else False,
                **extra,
            )
        if own is not None:
            own.took(out)
        hidden = None
        if self.hidden_layers:  # gathered where the logits are: the last layer's device under device_map="auto"
            hidden = torch.cat(
                [main_stream(out.hidden_states[i], self.text_config).to(out.logits.device) for i in self.hidden_layers],
                -1,
            )
        self.cache.commit(m, hidden)
        # As `generate`: float32 logits where the inputs are (the first GPU under device_map="auto"); a compiled
        # step's copy outlives the graph's output buffer.
        return out.logits.to(device=input_ids.device, dtype=torch.float32, copy=compiled)

    def _within_switches(self, position_ids: torch.Tensor, real: list[int], check: bool) -> torch.Tensor:
        """The positions of a forward whose rotary embedding switches by its last position: padding is placed at the
        last real position (its outputs are never read), and the real ones must lie on one side of every switch."""
        first = min(int(row[:r].min()) for row, r in zip(position_ids, real))
        last = max(int(row[:r].max()) for row, r in zip(position_ids, real))
        room = positions_room(self.rope_switches, first) if check else None
        if room is not None and last - first > room:
            raise RuntimeError(
                f"a forward of positions {first}..{last} straddles a switch of {type(self.model).__name__}'s rotary "
                f"embedding (room for {room} past {first}): the engine must not feed it"
            )
        return position_ids.clamp(max=last)


def main_stream(states: torch.Tensor, text_config=None) -> torch.Tensor:
    """[rows, q, hidden] of a layer's hidden states: a model that carries several streams through its layers gives
    one. Gemma 3n's AltUp ([streams, rows, q, hidden]): the first, the one its layers compute and the others follow.
    DeepSeek-V4's hyper-connections ([rows, q, hc_mult, hidden], `text_config.hc_mult`), which no stream leads: their
    mean."""
    if states.dim() != 4:
        return states
    if getattr(text_config, "hc_mult", None) == states.shape[2]:
        return states.mean(dim=2)
    return states[0]


# A forward is padded by a position only where that is clearly cheaper than the unpadded one, not within noise.
PAD_MARGIN = 0.05


def cheaper_width(m: int, rows: int, forward_costs: dict[int, float]) -> int:
    """m + 1 where `forward_costs` measured a forward of rows x (m + 1) tokens PAD_MARGIN cheaper than one of
    rows x m, else m."""
    fed, wider = forward_costs.get(rows * m), forward_costs.get(rows * (m + 1))
    return m + 1 if fed is not None and wider is not None and wider < (1 - PAD_MARGIN) * fed else m


def static_width(m: int, max_width: int) -> int:
    """The width a verify of m tokens is padded to on the static path: the next power of two, at most
    `max_width`. A drafter of up to 16 tokens thus needs graphs for 6 widths (1, 2, 4, 8, 16, 17), not 17."""
    if not 1 <= m <= max_width:
        raise ValueError(f"a verify of {m} tokens on a static path sized for at most {max_width}")
    return min(1 << (m - 1).bit_length(), max_width)
