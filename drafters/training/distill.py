"""Self-distillation data: what THIS verifier says, cached on disk stage by stage.

Stage `generate`: the verifier answers training prompts greedily, in batches, one shard file per
    batch, so a rerun resumes at the first missing shard. Prompts: drafters.training.corpus, optionally with
    user turns sampled from the verifier itself (`synthetic_user_turns`).
Stage `features`: one teacher-forced verifier forward per sequence (generated answers and local
    source documents) records, per position p, what a drafter trains on:
      - the fused hidden states of `layers` (float16): the drafter's context keys/values;
      - greedy[p] = the verifier's argmax after x[:p+1], and its top-k probabilities (soft labels);
    On any text, greedy[p] is an exact target when x[:p+1] is itself the verifier's greedy chain,
    so local documents give exact targets along their greedy-consistent spans (`on_chain`).
The held-out split: every HELD_OUT_EVERY-th generated answer is held out of training (of the drafter and of
the n-gram store), and scored by the held-out estimate (drafters.training.estimate, experiments.heldout).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from drafters.training.corpus import source_documents
from verifiers.prompts import encode_prompt
from verifiers.verifier import main_stream

HELD_OUT_EVERY = 20  # every 20th generated answer is held out of training
FRUITLESS_ROUNDS = 8  # sampled batches without a new user turn before synthetic_user_turns gives up
MAX_ANSWER_TOKENS = 256  # the longest answer the verifier gives a training prompt (train.py's --max-new-tokens)


def _pad_id(tokenizer) -> int:
    """What batched generation pads with: the tokenizer's pad token, else its EOS, else token 0 (padding is masked)."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    return 0


def _user_turn(tokenizer, user: str) -> list[int]:
    return encode_prompt(tokenizer, user)[0].tolist()


def synthetic_user_turns(
    model,
    tokenizer,
    count: int,
    out_file: Path,
    batch_size: int = 256,
    max_new_tokens: int = 64,
    seed: int = 0,
    log=print,
) -> list[str]:
    """`count` user turns sampled from the verifier itself (temperature 1 after its chat template's user header),
    cached in `out_file`: more varied prompts than templates give, in the verifier's own idea of a request. A tokenizer
    without a chat template, or a verifier that ends no turn in `FRUITLESS_ROUNDS` batches, is refused with the fix
    (--prompts)."""
    if out_file.exists():
        return json.loads(out_file.read_text())[:count]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template, so there is no user header to sample user turns after: "
            'give the prompts with --prompts FILE.jsonl (one {"prompt": ...} a line) instead of --synthetic-prompts'
        )
    marker = "\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    header = tokenizer(rendered[: rendered.index(marker)], add_special_tokens=False, return_tensors="pt")["input_ids"]
    stop = (
        tokenizer.convert_tokens_to_ids("<|im_end|>")
        if "<|im_end|>" in tokenizer.get_vocab()
        else tokenizer.eos_token_id
    )
    if stop is None:
        raise ValueError(
            f"{type(tokenizer).__name__} names no end-of-turn token (<|im_end|> or an EOS) to end a sampled user turn "
            "at: give the prompts with --prompts FILE.jsonl instead of --synthetic-prompts"
        )
    pad = _pad_id(tokenizer)
    torch.manual_seed(seed)
    turns, seen, start, fruitless = [], set(), time.time(), 0
    while len(turns) < count:
        if fruitless == FRUITLESS_ROUNDS:
            raise ValueError(
                f"the verifier ended no new user turn of at least 12 characters in {FRUITLESS_ROUNDS} batches of "
                f"{min(batch_size, count)} samples ({len(turns)} of {count} so far): give the prompts with --prompts "
                "FILE.jsonl instead of --synthetic-prompts"
            )
        before = len(turns)
        ids = header.expand(min(batch_size, count), -1).to(model.device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=0.95,
                eos_token_id=stop,
                pad_token_id=pad,
            )
        for row in out[:, header.shape[1] :].tolist():
            if stop not in row:  # cut off mid-request: not a whole user turn
                continue
            text = tokenizer.decode(row[: row.index(stop)], skip_special_tokens=True).strip()
            if len(text) >= 12 and text not in seen:
                seen.add(text)
                turns.append(text)
        fruitless = fruitless + 1 if len(turns) == before else 0
        log(f"synthetic prompts: {len(turns)}/{count}, {time.time() - start:.0f}s")
    turns = turns[:count]
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(turns))
    return turns


def precision_suffix(dtype: str) -> str:
    """What the names of a stage's cached files add for a verifier not in float32 (float32 names stay as they were)."""
    return "" if dtype == "float32" else f"-{dtype}"


def synthetic_turns_name(count: int, seed: int, dtype: str = "float32") -> str:
    """The file under a work dir that caches `count` user turns sampled from the verifier with `seed`."""
    return f"synthetic-prompts-{count}-s{seed}{precision_suffix(dtype)}.json"


def answers_suffix(max_new_tokens: int, dtype: str) -> str:
    """What the name of a folder of answers adds for another answer length or a verifier not in float32."""
    return ("" if max_new_tokens == MAX_ANSWER_TOKENS else f"-n{max_new_tokens}") + precision_suffix(dtype)


def synthetic_answers_name(
    gen_batch: int, count: int, max_new_tokens: int = MAX_ANSWER_TOKENS, dtype: str = "float32"
) -> str:
    """The folder under a work dir the generate stage writes its answers to, for the templated prompts interleaved
    with `count` sampled user turns, `gen_batch` a shard."""
    return f"generated-b{gen_batch}-syn{count}{answers_suffix(max_new_tokens, dtype)}"


def shard_path(gen_dir: Path, index: int) -> Path:
    """The file of the generate stage's `index`-th shard of answers."""
    return gen_dir / f"gen-{index:05d}.json"


def interleave(a: list, b: list) -> list:
    """a and b merged evenly, so any prefix of the result holds both in proportion (a cut-short run stays mixed)."""
    keyed = [((i + 0.5) / len(a), 0, x) for i, x in enumerate(a)] + [
        ((i + 0.5) / len(b), 1, x) for i, x in enumerate(b)
    ]
    return [x for *_, x in sorted(keyed, key=lambda t: t[:2])]


def generate_shards(
    model,
    tokenizer,
    prompts: list[str],
    out_dir: Path,
    minutes: float,
    batch_size: int = 64,
    max_new_tokens: int = MAX_ANSWER_TOKENS,
    max_shards: int | None = None,
    log=print,
) -> None:
    """Greedy answers to `prompts`, `batch_size` per shard: the first `max_shards` shards, or as many as
    `minutes` of work allow."""
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)][:max_shards]
    pad = _pad_id(tokenizer)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    start, made = time.time(), 0
    for index, batch in enumerate(batches):
        path = shard_path(out_dir, index)
        if path.exists():
            continue
        if time.time() - start > minutes * 60:
            break
        encoded = [_user_turn(tokenizer, p) for p in batch]
        width = max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        t0 = time.time()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        rows = []
        for prompt, new in zip(encoded, out[:, width:].tolist()):
            end = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            rows.append({"ids": prompt + new[:end], "prompt_len": len(prompt)})
        tmp = path.with_suffix(".part")
        tmp.write_text(json.dumps(rows))
        tmp.rename(path)
        tokens = sum(len(r["ids"]) - r["prompt_len"] for r in rows)
        made += tokens
        log(
            f"generate: shard {index + 1}/{len(batches)}: {tokens} tokens in {time.time() - t0:.0f}s "
            f"({tokens / (time.time() - t0):.0f} tok/s), {made} this run, {time.time() - start:.0f}s elapsed"
        )


def load_sequences(
    gen_dir: Path, tokenizer, doc_tokens: int, max_len: int = 640, max_shards: int | None = None
) -> list[dict]:
    """Generated sequences (of the first `max_shards` shards), then local documents (about `doc_tokens`
    tokens of them), each cut to `max_len`."""
    sequences = []
    for path in sorted(gen_dir.glob("gen-*.json"))[:max_shards]:
        sequences += [dict(r, ids=r["ids"][:max_len], source="generated") for r in json.loads(path.read_text())]
    budget = doc_tokens
    for user, text in source_documents():
        if budget <= 0:
            break
        prompt = _user_turn(tokenizer, user)  # then the document as the assistant's answer
        ids = (prompt + tokenizer(text, add_special_tokens=False)["input_ids"])[:max_len]
        sequences.append({"ids": ids, "prompt_len": len(prompt), "source": "document"})
        budget -= len(ids) - len(prompt)
    return sequences


class FeatureStore:
    """Memory-mapped arrays over all sequences, concatenated; `offsets[i]:offsets[i+1]` is sequence i."""

    def __init__(self, root: Path):
        meta = json.loads((root / "meta.json").read_text())
        self.layers, self.top_k, self.hidden_size = meta["layers"], meta["top_k"], meta["hidden_size"]
        self.offsets = np.array(meta["offsets"])
        self.prompt_lens = np.array(meta["prompt_lens"])
        self.sources = meta["sources"]
        n = int(self.offsets[-1])
        open_ = lambda name, dtype, shape: np.memmap(root / name, dtype=dtype, mode="r", shape=shape)  # noqa: E731
        self.ids = open_("ids.bin", np.int32, (n,))
        self.greedy = open_("greedy.bin", np.int32, (n,))
        self.top_ids = open_("top_ids.bin", np.int32, (n, self.top_k))
        self.top_probs = open_("top_probs.bin", np.float16, (n, self.top_k))
        self.hidden = open_("hidden.bin", np.float16, (n, len(self.layers) * self.hidden_size))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def move_hidden(self, device: torch.device) -> None:
        """Hold the hidden states as one tensor on `device` (an accelerator holds them all; batches gather there)."""
        self.hidden = torch.from_numpy(np.ascontiguousarray(self.hidden)).to(device)

    def sequence(self, i: int) -> dict:
        a, b = self.offsets[i], self.offsets[i + 1]
        return {
            "ids": self.ids[a:b],
            "greedy": self.greedy[a:b],
            "top_ids": self.top_ids[a:b],
            "top_probs": self.top_probs[a:b],
            "hidden": self.hidden[a:b],
            "prompt_len": int(self.prompt_lens[i]),
        }


def build_features(
    model,
    sequences: list[dict],
    root: Path,
    layers: tuple[int, ...],
    top_k: int = 8,
    batch_tokens: int = 4096,
    log=print,
    save_every: float = 60.0,
) -> FeatureStore:
    """Teacher-forced verifier features for `sequences`; written once, then reused (delete `root` to rebuild). An
    interrupted build resumes from its last saved batch: every `save_every` seconds the arrays are flushed and the
    batch reached is written to progress.json (the batches' order is fixed by the sequences, so a resumed build
    writes what an uninterrupted one would)."""
    if (root / "meta.json").exists():
        return FeatureStore(root)
    root.mkdir(parents=True, exist_ok=True)
    hidden_size = model.config.hidden_size
    lengths = [len(s["ids"]) for s in sequences]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    progress_file = root / "progress.json"
    shape = {"tokens": n, "sequences": len(lengths), "layers": list(layers), "top_k": top_k}
    progress = json.loads(progress_file.read_text()) if progress_file.exists() else {}
    resumed = progress.get("shape") == shape
    mode = "r+" if resumed else "w+"
    create = lambda name, dtype, shape: np.memmap(root / name, dtype=dtype, mode=mode, shape=shape)  # noqa: E731
    ids = create("ids.bin", np.int32, (n,))
    greedy = create("greedy.bin", np.int32, (n,))
    top_ids = create("top_ids.bin", np.int32, (n, top_k))
    top_probs = create("top_probs.bin", np.float16, (n, top_k))
    hidden = create("hidden.bin", np.float16, (n, len(layers) * hidden_size))
    arrays = (ids, greedy, top_ids, top_probs, hidden)
    # Batches of similar length (right-padded: causal attention makes the padding invisible to real tokens).
    order = sorted(range(len(sequences)), key=lambda i: lengths[i])
    done, i = (progress["done"], progress["next"]) if resumed else (0, 0)
    if resumed:
        log(f"features: resumed at {done}/{n} tokens")
    start, saved, first = time.time(), time.time(), done
    text = model.config.get_text_config()  # its hidden states' streams (`main_stream`)
    while i < len(order):
        j = i + max(1, batch_tokens // lengths[order[i]])
        batch = order[i:j]
        width = max(lengths[k] for k in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        for row, k in enumerate(batch):
            x[row, : lengths[k]] = torch.tensor(sequences[k]["ids"])
        with torch.inference_mode():
            out = model(input_ids=x.to(model.device), output_hidden_states=True)
            top = torch.softmax(out.logits.float(), dim=-1).topk(top_k, dim=-1)
            top_values, top_indices = top.values.half().cpu(), top.indices.cpu()
            states = torch.cat([main_stream(out.hidden_states[layer], text) for layer in layers], dim=-1)
            states = states.half().cpu()
        del out
        for row, k in enumerate(batch):
            a, m = offsets[k], lengths[k]
            ids[a : a + m] = x[row, :m].numpy()
            greedy[a : a + m] = top_indices[row, :m, 0].numpy()
            top_ids[a : a + m] = top_indices[row, :m].numpy()
            top_probs[a : a + m] = top_values[row, :m].numpy()
            hidden[a : a + m] = states[row, :m].numpy()
        done += sum(lengths[k] for k in batch)
        i = j
        if time.time() - saved >= save_every:
            for array in arrays:
                array.flush()
            progress_file.write_text(json.dumps({"shape": shape, "next": i, "done": done}))
            saved = time.time()
        log(f"features: {done}/{n} tokens, {(done - first) / (time.time() - start):.0f} tok/s")
    for array in arrays:
        array.flush()
    meta = {
        "layers": list(layers),
        "top_k": top_k,
        "hidden_size": hidden_size,
        "offsets": offsets.tolist(),
        "prompt_lens": [s["prompt_len"] for s in sequences],
        "sources": [s["source"] for s in sequences],
    }
    (root / "meta.json").write_text(json.dumps(meta))
    progress_file.unlink(missing_ok=True)
    return FeatureStore(root)


# -- the held-out split -------------------------------------------------------------------------------


def held_out_indices(sources: list[str], every: int = HELD_OUT_EVERY) -> set[int]:
    """Indices of the held-out sequences, given each one's source: every `every`-th generated answer."""
    return set([i for i, source in enumerate(sources) if source == "generated"][::every])


def split(store: FeatureStore) -> tuple[list[int], list[int]]:
    """(train, held-out): every HELD_OUT_EVERY-th generated answer is held out; documents all train."""
    held = held_out_indices(store.sources)
    return [i for i in range(len(store)) if i not in held], sorted(held)
