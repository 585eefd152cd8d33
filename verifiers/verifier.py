"""The AR verifier: one prefill, then k drafted tokens + the bonus position scored in ONE forward.

The cache (`verifiers.cache.SharedCache`) holds every committed token except the newest one (the
"pending" token the verifier has just chosen and not yet run). A verify step feeds
`[pending, d_1 .. d_k]` for every row, which yields the verifier's distribution after each of them;
after acceptance, `rollback` forgets the rejected drafts by moving each row's length back. Nothing
is recomputed.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache, GenerationMixin, PreTrainedModel

from verifiers.cache import (
    SEVERAL_TOKENS,
    SharedCache,
    attention_pattern,
    cache_feed_problem,
    cache_feed_refusal,
    cache_layer_sources,
    keeps_recurrent_state,
    learned_position_limit,
    mask_problem,
    masked_window_problem,
    prompt_holes,
    row_mask_problem,
    slot_position_problem,
    storing_layers,
    tree_layout,
)
from verifiers.kernels import chosen_kernels, cpu_linears, forget_changed_weights, prepare_linears
from verifiers.positions import positions_room, rope_switches
from verifiers.step_inputs import rereads
from verifiers.verdicts import built_of_own_modules, least_precise_dtype, probe_tokens, probed

STATIC_CAPACITY_STEP = 256  # static caches are sized in multiples of this many slots


def adapted_model(model):
    """`model`, or the causal LM inside a PEFT `PeftModel` whose adapters act within that model's layers (LoRA and
    its kin), where `peft_model.generate` is that model's own `generate`, adapters included. Prompt-learning adapters
    (prefix, prompt and p-tuning) feed tokens or cache of their own around the model, which a verify would not see:
    refused by name. (Read by duck typing: PEFT is not a dependency.)"""
    config = getattr(model, "active_peft_config", None)
    if isinstance(model, PreTrainedModel) or config is None or not callable(getattr(model, "get_base_model", None)):
        return model
    if getattr(config, "is_prompt_learning", False):
        raise TypeError(
            f"{type(model).__name__} carries a prompt-learning adapter ({getattr(config, 'peft_type', '?')}), whose "
            "virtual tokens a verify of the causal LM would not see: decode it with its own generate, or use an "
            "adapter that acts within the model's layers (LoRA)"
        )
    return model.get_base_model()


def check_causal_lm(model, role: str = "verifier") -> None:
    """Raise a clear error unless `model` is a decoder-only Hugging Face LM that can generate."""
    if isinstance(getattr(model, "_orig_mod", None), PreTrainedModel):  # torch.compile's wrapper
        raise TypeError(
            f"{role} is a torch.compile wrapper ({type(model).__name__}): pass the model itself (its _orig_mod); "
            "hybrid compiles its own decoding step, as model.generate does, with cache_implementation='static' "
            "(and compile_config to choose how)"
        )
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise TypeError(
            f"{role} must be a Hugging Face causal LM (a PreTrainedModel with generate), got {type(model).__name__}: "
            "load it with AutoModelForCausalLM.from_pretrained(...)"
        )
    if model.config.is_encoder_decoder or not model.can_generate():
        raise TypeError(
            f"{type(model).__name__} is not a decoder-only causal LM: hybrid verifies with an "
            "AutoModelForCausalLM (encoder-decoder and encoder-only models are not supported)"
        )
    if attends_ahead(model):
        if getattr(model.config.get_text_config(), "is_decoder", None) is False:
            raise TypeError(
                f"{type(model).__name__} attends to the tokens after each position (its config has "
                "is_decoder=False), so no forward of several tokens scores them as model.generate decodes them one "
                "by one: load it with is_decoder=True"
            )
        raise TypeError(
            f"{type(model).__name__}'s output at a position depends on the tokens after it in the same forward "
            "(attention that looks ahead, or layers that mix a forward's tokens, as torch.ao's dynamic "
            "quantization does by scaling them all by their common range, or bitsandbytes' LLM.int8 by taking "
            "outlier columns wherever any token has them), so no forward of several tokens scores them as "
            "model.generate decodes them one by one: use a causal LM whose layers compute each token from its own "
            "row (quantize weights only, as 4-bit bitsandbytes does, or activations per token), or decode with "
            "model.generate"
        )
    if scores_depend_on_width(model):
        raise TypeError(
            f"{type(model).__name__}'s scores for a token depend on how many tokens its forward feeds, past the "
            "rounding of the dtype it computes in (as some int8 products of activations quantized on the fly do, "
            "choosing kernels by shape), so no verify of several tokens reproduces model.generate's one-token "
            "steps: quantize weights only, or decode with model.generate"
        )


def attends_ahead(model) -> bool:
    """Whether `model`'s output at a position depends on tokens after it in the same forward, as a BERT-family LM
    head's does when loaded without is_decoder=True, a model whose linears torch.ao quantized dynamically (one
    activation scale for all of a forward's tokens) or bitsandbytes' LLM.int8 with outlier columns (taken wherever
    any of a forward's tokens exceeds the threshold). Self-attention modules that all declare is_causal=True, in a
    model built of torch's and transformers' own modules with plain parameters, settle it; otherwise forwards of
    four tokens tell, once per kind of model (`verifiers.verdicts.probed`): the earlier outputs must not move when
    the last token changes, nor when its input is one large feature."""
    declared = [
        module.is_causal
        for module in model.modules()
        if isinstance(getattr(module, "is_causal", None), bool)
        and not getattr(module, "is_cross_attention", False)
        and "cross" not in type(module).__name__.lower()
    ]
    if declared and all(declared) and built_of_own_modules(model):
        return False
    return probed(model, _changes_earlier_outputs, failed=False)


def padding_changes_outputs(model) -> bool:
    """Whether `model.generate`'s logits for a left-padded row differ from the same row's alone, as GIT's do (its
    decoding steps widen a 2-D mask by its image tokens, moving a padded row's mask off its slots). hybrid decodes
    each row as if it were alone, so it cannot follow such a model's padded rows. Told by two greedy `generate` calls
    of two new tokens each (the prefill and a cached step), once per model."""
    return probed(model, _padded_logits_differ, failed=False)


def scores_depend_on_width(model) -> bool:
    """Whether `model`'s scores for a token move with the number of tokens its forward feeds by more than the
    rounding of the dtype it computes in, as torchao's and bitsandbytes' int8 products of activations quantized per
    token do on a CPU: a prefill or a verify then scores other numbers than `generate`'s. A model built of torch's
    and transformers' own modules with plain parameters rounds by width only as its dtype does; any other is told by
    forwards of every prefix of 16 tokens against the whole, and cached forwards of 2 to 8 tokens against the same
    tokens fed one by one, once per kind of model (`verifiers.verdicts.probed`)."""
    return not built_of_own_modules(model) and probed(model, _width_changes_scores, failed=False)


def settle_probes(model) -> None:
    """Run now every probe a call may ask of `model` (each keeps its verdict, `verifiers.verdicts.probed`): a loader
    calls it so that no first call pays for them."""
    check_causal_lm(model)
    padding_changes_outputs(model)
    for width in (1, SEVERAL_TOKENS):
        cache_feed_problem(model, width)


def _relative_difference(reference: torch.Tensor, other: torch.Tensor) -> float:
    """How far `other` is from `reference`, as a share of the largest magnitude in `reference` (float32)."""
    reference, other = reference.float(), other.float()
    return float((other - reference).abs().max() / reference.abs().max())


_LOGITS_DIFFER = 1e-3  # a relative difference of logits past float noise: the model computed something else


def _changes_earlier_outputs(model) -> bool:
    tokens, other = probe_tokens(model, 4)
    changed = tokens.clone()
    changed[0, -1] = other
    before = model(tokens, use_cache=False).logits[0, :-1]
    after = model(changed, use_cache=False).logits[0, :-1]
    if _relative_difference(before, after) > _LOGITS_DIFFER:
        return True
    # A range taken over the whole forward (LLM.int8's outlier columns, a per-tensor activation scale) may not move
    # with another token of the vocabulary, and moves with one large feature, which normalization keeps large.
    embeds = model.get_input_embeddings()(tokens)
    spiked = embeds.clone()
    spiked[0, -1] = 0
    spiked[0, -1, embeds.shape[-1] // 2] = 10 * embeds.abs().max()
    try:
        before = model(inputs_embeds=embeds, use_cache=False).logits[0, :-1]
    except (TypeError, ValueError):  # a model that takes token ids only: the tokens told what they can
        return False
    after = model(inputs_embeds=spiked, use_cache=False).logits[0, :-1]
    return _relative_difference(before, after) > _LOGITS_DIFFER


def _width_changes_scores(model) -> bool:
    tokens, _ = probe_tokens(model, 16)
    limit = max(_LOGITS_DIFFER, 8 * torch.finfo(least_precise_dtype(model)).eps)  # several rounding steps

    def differs(reference: torch.Tensor, other: torch.Tensor) -> bool:
        return _relative_difference(reference, other) > limit

    # A prefill: each prefix against the whole (some kernels change at a particular width, not at every one)
    whole = model(tokens, use_cache=False).logits[0]
    if any(differs(whole[:n], model(tokens[:, :n], use_cache=False).logits[0]) for n in range(1, 16)):
        return True

    # A verify: tokens fed together on top of a cache against the same fed one by one, as `generate` decodes
    def prefilled() -> DynamicCache:
        cache = DynamicCache(config=model.config)
        model(tokens[:, :2], cache=cache, use_cache=True)
        return cache

    cache = prefilled()
    one_by_one = torch.cat([model(tokens[:, i : i + 1], cache=cache, use_cache=True).logits[0] for i in range(2, 10)])
    together = (model(tokens[:, 2 : 2 + n], cache=prefilled(), use_cache=True).logits[0] for n in range(2, 9))
    return any(differs(one_by_one[: len(scores)], scores) for scores in together)


def _padded_logits_differ(model) -> bool:
    tokens, pad = probe_tokens(model, 3)
    padded = torch.cat([tokens.new_full((1, 2), pad), tokens], dim=1)
    settings = dict(
        max_new_tokens=2,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
        output_logits=True,
        return_dict_in_generate=True,
        disable_compile=True,  # a probe of four tiny forwards: compiling them would cost more than it saves
    )
    generate = type(model).generate  # transformers' own, even where hybrid stands in for the instance's
    alone = generate(model, tokens, attention_mask=torch.ones_like(tokens), **settings).logits
    mask = torch.ones_like(padded)
    mask[0, :2] = 0
    beside = generate(model, padded, attention_mask=mask, **settings).logits
    return any(_relative_difference(a, b) > _LOGITS_DIFFER for a, b in zip(alone, beside))


def _holed_rows(masks: list[torch.Tensor | None]) -> list[int]:
    """The rows whose prompt mask masks a token after the row's first unmasked one."""
    return [b for b, mask in enumerate(masks) if mask is not None and bool(prompt_holes(mask)[-1])]


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
            `schedulers.cost_model.cached_kernel_choice`); every other product runs PyTorch's own kernel.
        forward_costs: the machine's measured seconds of a forward feeding n tokens (`schedulers.cost_model
            .forward_costs`; empty: none cached). An eager verify is padded by one position per row where that
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
        check_causal_lm(model, role)
        text = model.config.get_text_config()
        num_states = text.num_hidden_layers + 1
        bad = [i for i in hidden_layers if not -num_states <= i < num_states]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range for a model with {num_states - 1} layers")
        if keeps_recurrent_state(model):
            raise ValueError(
                f"{type(model).__name__} keeps state that cannot be rolled back by cropping "
                "(linear attention / recurrent layers): speculative decoding needs a croppable KV cache"
            )
        attention_pattern(text)  # raises for attention kinds the cache cannot serve
        cache_layer_sources(text)  # raises for a looped model whose loops read the cache past Cache.update
        # A verifier fed one token per forward (drafter=None) runs what `generate` runs; anything wider needs a mask.
        several = role != "verifier" or max_width > 1
        problem = mask_problem(text)
        if problem and several:
            fix = "pass drafter=None (one token per forward, as model.generate)" if role == "verifier" else ""
            raise ValueError(
                f"{type(model).__name__} cannot be a {role} that scores several tokens per forward: {problem}"
                + (f", or {fix}" if fix else "")
            )
        refusal = cache_feed_refusal(model, several, role)
        if refusal:
            raise ValueError(refusal)
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self.hidden_width = len(self.hidden_layers) * text.hidden_size if self.hidden_layers else 0
        self._supports_logits_to_keep = model._supports_logits_to_keep()
        # Rows of different lengths need per-row masks; a model that cannot take them runs one row per forward.
        self.row_mask_problem = row_mask_problem(model)
        self.batches = self.row_mask_problem is None
        # A learned position table ends; past it `generate` fails too, so `hybrid.generate` refuses such a call up
        # front and a real token's position is never clamped here.
        self.max_positions = learned_position_limit(model)
        # Rotary embeddings whose frequencies follow a forward's last position (`verifiers.positions`): every forward
        # keeps its positions on one side of their switches.
        self.rope_switches = rope_switches(model)
        # Positions at which the model's `generate` drops its cache and re-reads the sequence (`plan_rereads`).
        self.rereads: list[int] = []
        if static and self.row_mask_problem:
            raise ValueError(
                f"cache_implementation='static' reads the cache through hybrid's own per-row masks, and "
                f"{type(model).__name__} cannot take them: {self.row_mask_problem}. Drop cache_implementation "
                "(the dynamic path serves this model)"
            )
        self.static = static
        self.max_width = max_width
        self.compile_config = compile_config
        self.step_call = model if compile_config is None else model.get_compiled_call(compile_config)
        # An eager forward runs each linear's product through the kernel measured fastest at its row count
        # (`verifiers.kernels`); a compiled step keeps the kernels it was traced with.
        self.linears = cpu_linears(model) if compile_config is None else []
        self.row_kernels = dict(row_kernels or {})
        self._kernels_in_place = False  # inside `kernels()`: each forward finds its kernels installed
        # The one-position padding is for eager forwards, whose kernels follow the row count.
        self.forward_costs = dict(forward_costs or {}) if compile_config is None and not static else {}
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

    def check_masks(self, masks: list[torch.Tensor | None]) -> None:
        """Raise unless this model can honour every prompt mask (1-D, 0 = masked; None: none) as `generate` does:
        `generate` counts a masked token as a position where the model's forward takes no position_ids
        (`verifiers.cache.slot_position_problem`), and a masked token after a row's first unmasked one in attention
        windows that some models apply themselves (`verifiers.cache.masked_window_problem`); and some models'
        `generate` lets a padded row's output depend on its padding (`padding_changes_outputs`)."""
        masked = [b for b, mask in enumerate(masks) if mask is not None and not bool(mask.all())]
        problem = slot_position_problem(self.model) if masked else None
        if problem is not None:
            raise ValueError(
                f"attention_mask masks tokens of row {masked[0]}, and {type(self.model).__name__} cannot be told "
                f"where a row's tokens sit ({problem}): model.generate counts the masked tokens as positions of that "
                "row, while hybrid places a row's tokens as if it were alone. Pass prompts without padding (one "
                "call per row), or decode them with model.generate"
            )
        if masked and padding_changes_outputs(self.model):
            raise ValueError(
                f"attention_mask masks tokens of row {masked[0]}, and model.generate's output for a padded row of "
                f"{type(self.model).__name__} depends on its padding (its logits for a left-padded row differ from "
                "the row's alone), while hybrid decodes a row as if it were alone. Pass prompts without padding (one "
                "call per row), or decode them with model.generate"
            )
        holed = _holed_rows(masks)
        if not holed:
            return
        problem = masked_window_problem(self.model)
        if problem is not None:
            mask = masks[holed[0]]
            first = int(mask.nonzero()[0, 0])
            hole = first + int((mask[first:] == 0).nonzero()[0, 0])
            raise ValueError(
                f"attention_mask masks position {hole} of row {holed[0]}, after the row's first token, and "
                f"{type(self.model).__name__} cannot count it in its attention as model.generate does "
                f"({problem}): mask only leading (left-padding) tokens, or decode this prompt with model.generate"
            )

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
        self.check_masks(masks)
        if self.static:  # calls of similar length share a capacity, hence their compiled graphs
            capacity = -(-capacity // STATIC_CAPACITY_STEP) * STATIC_CAPACITY_STEP
        logits = self._prefill(rows, capacity, masks, own_mask=False)
        holed = _holed_rows(masks)
        if holed and self.cache.holes is not None:
            logits = self._prefill_as_generate(rows, capacity, masks, holed, logits)
        return logits

    def _prefill(self, rows, capacity: int, masks, own_mask: bool) -> torch.Tensor:
        """A fresh cache holding `rows`; the logits after each one's last token. `own_mask`: through the model's own
        mask even where a masked prompt token sits inside a sliding window."""
        self.cache = SharedCache(
            self.model, len(rows), capacity, self.hidden_width, static=self.static, windows_by_mask=self.batches
        )
        self.cache.mark_masked(masks)
        self.cache.prefill_by_own_mask = own_mask
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

        windowed = _relative_difference(reference, logits[holed])
        if windowed <= _LOGITS_DIFFER:
            return logits
        windowed_cache = self.cache
        own = self._prefill(rows, capacity, masks, own_mask=True)
        if _relative_difference(reference, own[holed]) < windowed:
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
        """Whether a verify may feed token trees: they need the per-row masks only some models take."""
        return self.row_mask_problem is None

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
    def keep_rows(self, kept: list[list[int]]) -> None:
        """After a verify, row b keeps the fed tokens kept[b] (increasing offsets): a tree's accepted path."""
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
        self.rollback_rows([num_tokens])

    @property
    def num_cached(self) -> int:
        return self.length(0)

    @property
    def next_position(self) -> int:
        return self.length(0)

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
        installed = self._kernels_in_place
        with contextlib.nullcontext() if installed else chosen_kernels(self.linears, self.row_kernels, rows):
            out = call(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                cache=self.cache,
                use_cache=True,
                # By index, so that only the kept layers' states are held: the others are freed layer by layer.
                output_hidden_states=list(self.hidden_layers) if self.hidden_layers else False,
                **extra,
            )
        hidden = None
        if self.hidden_layers:  # gathered where the logits are: the last layer's device under device_map="auto"
            hidden = torch.cat(
                [main_stream(out.hidden_states[i]).to(out.logits.device) for i in self.hidden_layers], -1
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


def main_stream(states: torch.Tensor) -> torch.Tensor:
    """[rows, q, hidden] of a layer's hidden states: a model that carries several streams through its layers (Gemma
    3n's AltUp, [streams, rows, q, hidden]) gives the first, the one its layers compute and the others follow."""
    return states[0] if states.dim() == 4 else states


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
