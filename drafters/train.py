"""Train a drafter for a verifier by self-distillation, fully offline, resumable at every stage.

    python -m drafters.train                       # the CPU recipe: block-diffusion drafter, ~55 min on 2 cores
    python -m drafters.train --arch ar             # the 1-layer AR baseline, same data and trainable budget
    bash experiments/gpu_train.sh OUT              # the GPU recipe of the shipped checkpoint (these options, scaled)

The shipped checkpoint (drafters/checkpoints/smollm2-135m-block) comes from the GPU recipe; its
training.json records the command and what the run cost. Drafters go to --work-dir/{block,ar}-drafter
unless --out says otherwise; copy a block drafter into drafters/checkpoints/ to ship it.

Stages, each cached under --work-dir (a rerun skips what is done; delete a folder to redo it):
  1. generate  the verifier answers --gen-shards x --gen-batch training prompts greedily (drafters.corpus,
               plus --synthetic-prompts user turns sampled from the verifier);
  2. features  one teacher-forced verifier pass over those answers and --doc-tokens of local documents
               records the fused hidden states, greedy targets and top-k soft labels (drafters.distill);
  3. train     --steps optimizer steps; a checkpoint every --save-every steps (resumed automatically),
               a held-out acceptance estimate (tau of one-pass greedy drafting) every --eval-every steps.
Seeded: the same command on the same data gives the same batches, resumed or not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from drafters.ar_baseline import make_ar_model, save_ar_model
from drafters.block_diffusion import (BlockDiffusionConfig, BlockDiffusionModel, check_fingerprint, frozen_verifier_parts,
                                      load_model, save_model, verifier_fingerprint)
from drafters.corpus import chat_prompts
from drafters.distill import (FeatureStore, build_features, generate_shards, interleave, load_sequences,
                              synthetic_user_turns)
from drafters.prompt_lookup import lookup_draft
from drafters.training import (VocabMap, accepted_lengths, anchor_candidates, block_targets, distill_loss,
                               draft_vocabulary, lr_at, position_weights)

DEFAULT_WORK_DIR = Path.home() / ".cache" / "hybrid" / "drafter"


# -- data split ---------------------------------------------------------------------------------------


HELD_OUT_EVERY = 20  # every 20th generated answer is held out of training


def held_out_indices(sources: list[str], every: int = HELD_OUT_EVERY) -> set[int]:
    """Indices of the held-out sequences, given each one's source: every `every`-th generated answer."""
    return set([i for i, source in enumerate(sources) if source == "generated"][::every])


def split(store: FeatureStore) -> tuple[list[int], list[int]]:
    """(train, held-out): every HELD_OUT_EVERY-th generated answer is held out; documents all train."""
    held = held_out_indices(store.sources)
    return [i for i in range(len(store)) if i not in held], sorted(held)


# -- block-diffusion batches --------------------------------------------------------------------------


def block_batch(store, seq_ids, rng, anchors_per_seq, block_size, vmap, reveal_prob=0.0, anchors=None):
    """Tensors for one step: S sequences x A anchors x B block positions (see drafters.training)."""
    seqs = [store.sequence(i) for i in seq_ids]
    S, A, B = len(seqs), anchors_per_seq, block_size
    width = max(len(s["ids"]) for s in seqs)
    on_device = isinstance(store.hidden, torch.Tensor)  # FeatureStore.move_hidden: gather where the states are
    hidden = torch.zeros(S, width, store.hidden.shape[1], device=store.hidden.device if on_device else "cpu")
    ids = torch.zeros(S, width, dtype=torch.long)
    anchor_pos = torch.zeros(S, A, dtype=torch.long)
    tokens = torch.zeros(S, A, B, dtype=torch.long)
    known = torch.zeros(S, A, B, dtype=torch.bool)
    targets = torch.full((S, A, B - 1), -1, dtype=torch.long)
    valid = torch.zeros(S, A, B - 1, dtype=torch.bool)  # stays False for anchor slots a short sequence leaves empty
    soft_ids = torch.full((S, A, B - 1, store.top_k), -1, dtype=torch.long)
    soft_probs = torch.zeros(S, A, B - 1, store.top_k)
    for row, s in enumerate(seqs):
        h = s["hidden"]
        ids[row, : len(s["ids"])] = torch.from_numpy(s["ids"].astype(np.int64))
        hidden[row, : len(s["ids"])] = h.float() if on_device else torch.from_numpy(np.asarray(h, dtype=np.float32))
        if anchors is None:
            cand = anchor_candidates(s)
            chosen = rng.choice(cand, size=min(A, len(cand)), replace=False) if len(cand) else cand
        else:
            chosen = np.asarray(anchors[row][:A])
        n = len(chosen)
        if not n:
            continue
        full, ok, rows = block_targets(s, chosen, B)
        anchor_pos[row, :n] = torch.from_numpy(chosen)
        tokens[row, :n, 0] = torch.from_numpy(s["ids"][chosen].astype(np.int64))
        tokens[row, :n, 1:] = torch.from_numpy(full.astype(np.int64))
        targets[row, :n] = vmap(full)
        valid[row, :n] = torch.from_numpy(ok)
        soft_ids[row, :n] = vmap(s["top_ids"][rows])
        soft_probs[row, :n] = torch.from_numpy(np.asarray(s["top_probs"][rows], dtype=np.float32))
    known[..., 0] = True
    if reveal_prob:  # some blocks see part of their answer, as a later denoising pass or a lookup prefix would
        reveal = torch.from_numpy(rng.random((S, A)) < reveal_prob)
        prefix = torch.from_numpy(rng.random((S, A)) < 0.5)
        cut = torch.from_numpy(rng.integers(1, B, size=(S, A)))
        pos = torch.arange(1, B)
        random_subset = torch.from_numpy(rng.random((S, A, B - 1))) < torch.from_numpy(rng.random((S, A, 1)))
        chosen = torch.where(prefix[..., None], pos < cut[..., None], random_subset) & valid & reveal[..., None]
        # Only valid positions are revealed: their tokens are the exact greedy chain the rest must continue.
        known[..., 1:] = chosen
    weights_mask = valid & ~known[..., 1:]
    return dict(hidden=hidden, ids=ids, anchors=anchor_pos, tokens=tokens, known=known, targets=targets, valid=valid,
                soft_ids=soft_ids, soft_probs=soft_probs, loss_mask=weights_mask, full_targets=tokens[..., 1:])


def block_forward(model: BlockDiffusionModel, embed, head, batch) -> torch.Tensor:
    """Draft-vocabulary logits [S, A, B-1, V'] for a batch from `block_batch`."""
    hidden, anchors, tokens, known = batch["hidden"], batch["anchors"], batch["tokens"], batch["known"]
    S, A, B = tokens.shape
    width, device = hidden.shape[1], tokens.device
    with torch.no_grad():
        embeds, context_embeds = embed(tokens), embed(batch["ids"])
    features = model.features(hidden, context_embeds)
    context = model.context(features, torch.arange(width, device=device)[None].expand(S, width))
    last = features.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(S, A, features.shape[-1]))  # [S, A, hidden]
    embeds = model.block_inputs(embeds, known, last)
    block_positions = (anchors[..., None] + torch.arange(B, device=device)).reshape(S, A * B)
    # Query (anchor j, position i) may see context positions < anchor j and all of block j.
    sees_context = torch.arange(width, device=device)[None, None, :] < anchors[:, :, None]  # [S, A, width]
    sees_context = sees_context[:, :, None, :].expand(S, A, B, width).reshape(S, A * B, width)
    block_id = torch.arange(A, device=device).repeat_interleave(B)
    sees_block = (block_id[:, None] == block_id[None, :])[None].expand(S, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]
    out = model(embeds.reshape(S, A * B, -1), block_positions, context, mask)
    out = out.reshape(S, A, B, -1)[:, :, 1:]
    return out @ head.T


# -- AR baseline batches ------------------------------------------------------------------------------


def ar_batch(store, seq_ids, vmap):
    seqs = [store.sequence(i) for i in seq_ids]
    width = max(len(s["ids"]) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    greedy = torch.full((len(seqs), width), -1, dtype=torch.long)
    soft_ids = torch.full((len(seqs), width, store.top_k), -1, dtype=torch.long)
    soft_probs = torch.zeros(len(seqs), width, store.top_k)
    for row, s in enumerate(seqs):
        n = len(s["ids"])
        ids[row, :n] = torch.from_numpy(s["ids"].astype(np.int64))
        mask[row, :n] = 1
        loss_mask[row, max(0, s["prompt_len"] - 1) : n - 1] = True  # every next-token target in the answer is exact
        greedy[row, :n] = torch.from_numpy(s["greedy"].astype(np.int64))
        soft_ids[row, :n] = vmap(s["top_ids"])
        soft_probs[row, :n] = torch.from_numpy(np.asarray(s["top_probs"], dtype=np.float32))
    return dict(ids=ids, mask=mask, loss_mask=loss_mask, full_targets=greedy, targets=vmap(greedy.clamp(min=0)),
                soft_ids=soft_ids, soft_probs=soft_probs)


def ar_forward(model, head, batch) -> torch.Tensor:
    out = model.model(input_ids=batch["ids"], attention_mask=batch["mask"]).last_hidden_state
    return out @ head.T


def feature_statistics(store, train_ids, seed: int, rows: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Robust per-dim centre and scale of the verifier features (median, half the 16-84 percentile range)."""
    rng = np.random.default_rng(seed)
    sample = np.concatenate([np.asarray(store.sequence(int(i))["hidden"], dtype=np.float32)
                             for i in rng.choice(train_ids, size=min(len(train_ids), 64), replace=False)])
    sample = sample[rng.choice(len(sample), size=min(rows, len(sample)), replace=False)]
    low, mid, high = np.percentile(sample, [16, 50, 84], axis=0)
    return torch.from_numpy(mid).float(), torch.from_numpy(np.maximum((high - low) / 2, 1e-3)).float()


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# -- held-out estimate --------------------------------------------------------------------------------


def held_out_anchors(store, held, per_seq: int, seed: int) -> list[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in held:
        cand = anchor_candidates(store.sequence(i))
        if len(cand):
            out.append((i, np.sort(rng.choice(cand, size=min(per_seq, len(cand)), replace=False))))
    return out


def greedy_block_drafts(model, embed, head, vocab, batch, passes: int = 1) -> torch.Tensor:
    """Greedy drafts [S, A, B-1] (full-vocabulary ids) of a `block_batch`'s anchors after `passes` denoising passes,
    each after the first with one more leading position fixed to the model's own prediction (what
    `BlockDiffusionDrafter` drafts with threshold 1)."""
    tokens, known = batch["tokens"].clone(), batch["known"].clone()
    for fixed in range(1, passes + 1):
        predicted = vocab[block_forward(model, embed, head, {**batch, "tokens": tokens, "known": known}).argmax(-1)]
        if fixed == passes or fixed == tokens.shape[-1] - 1:
            break
        tokens[..., fixed], known[..., fixed] = predicted[..., fixed - 1], True
    return torch.where(known[..., 1:], tokens[..., 1:], predicted)


@torch.no_grad()
def estimate_tau(arch, model, embed, head, store, anchors, vmap, vocab, block_size, device="cpu",
                 chunk_size: int = 4, passes: int = 1) -> tuple[float, np.ndarray]:
    """tau = 1 + mean accepted length of one greedy draft of block_size - 1 tokens per held-out anchor,
    and the acceptance rate by block position (share of anchors whose first i drafts are all accepted).
    A block drafter runs `passes` denoising passes, each after the first with one more leading position fixed
    to its own prediction (`BlockDiffusionDrafter` with threshold 1)."""
    model.eval()
    lengths = []
    vocab = vocab.to(device)
    for start in range(0, len(anchors), chunk_size):
        chunk = anchors[start : start + chunk_size]
        if arch == "block":
            batch = block_batch(store, [i for i, _ in chunk], None, max(len(a) for _, a in chunk), block_size, vmap,
                                anchors=[a for _, a in chunk])
            batch = to_device(batch, device)
            predicted = greedy_block_drafts(model, embed, head, vocab, batch, passes)
            got = accepted_lengths(predicted, batch["full_targets"], batch["valid"])
            lengths += [got[r, : len(a)] for r, (_, a) in enumerate(chunk)]
        else:
            batch = to_device(ar_batch(store, [i for i, _ in chunk], vmap), device)
            hit = (vocab[ar_forward(model, head, batch).argmax(-1)] == batch["full_targets"]) & batch["loss_mask"]
            for r, (_, a) in enumerate(chunk):
                # A teacher-forced AR pass scores every anchor at once: drafts from anchor a are accepted
                # while its predictions at a, a+1, ... match (it would have fed exactly those tokens).
                rows = (torch.from_numpy(a)[:, None] + torch.arange(block_size - 1)).to(device)
                inside = rows < hit.shape[1]
                got = hit[r, rows.clamp(max=hit.shape[1] - 1)] & inside
                lengths.append(got.long().cumprod(1).sum(1))
    model.train()
    lengths = torch.cat(lengths).cpu().numpy()
    by_position = np.array([(lengths >= i).mean() for i in range(1, block_size)])
    return 1 + float(lengths.mean()), by_position


def lookup_tau(store, anchors, block_size, ngrams=None, min_ngram: int = 1, store_min_n: int = 2, max_ngram: int = 3,
               prefer_store: float | None = None) -> float:
    """The same estimate for prompt lookup (n-gram min_ngram..max_ngram over prompt + answer so far; min_ngram = 0:
    none), continued by the n-gram store `ngrams` if given (`lookup_draft`), for reference."""
    lengths = []
    for i, chosen in anchors:
        s = store.sequence(i)
        ids = torch.from_numpy(s["ids"].astype(np.int64))
        for a in chosen:
            draft, _ = lookup_draft(ids[: a + 1], min_ngram, max_ngram, block_size - 1, ngrams, store_min_n, prefer_store)
            full, ok, _ = block_targets(s, np.array([a]), block_size)
            k = len(draft)
            hit = (draft.numpy() == full[0, :k]) & ok[0, :k]
            lengths.append(int(np.cumprod(hit).sum()))
    return 1 + float(np.mean(lengths))


# -- main ---------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m drafters.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=("block", "ar"), default="block", help="block-diffusion drafter or the 1-layer AR baseline")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="cache of generated data and features")
    p.add_argument("--out", type=Path, default=None, help="where the trained drafter goes (default: WORK_DIR/ARCH-drafter)")
    p.add_argument("--device", default="cpu", help="torch device for the verifier and the drafter (cpu, cuda, ...)")
    p.add_argument("--gen-shards", type=int, default=13, help="batches of --gen-batch training prompts the verifier answers "
                                                              "(-1: all of them)")
    p.add_argument("--gen-batch", type=int, default=64, help="prompts per generation batch (and shard)")
    p.add_argument("--gen-minutes", type=float, default=None, help="stop generating after this long (no limit by default)")
    p.add_argument("--synthetic-prompts", type=int, default=0, help="user turns sampled from the verifier, added to the "
                                                                    "templated prompts")
    p.add_argument("--doc-tokens", type=int, default=30_000, help="tokens of local documents (stdlib, pydoc) to add")
    p.add_argument("--feature-batch-tokens", type=int, default=4096, help="tokens per verifier pass in the features stage")
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--minutes", type=float, default=None, help="set --steps from the step time measured over the first "
                                                               "10 steps so training takes about this long")
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--anchors-per-seq", type=int, default=96)
    p.add_argument("--block-size", type=int, default=8, help="positions per block, anchor included")
    p.add_argument("--layers", type=int, default=1, help="drafter layers (block arch)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this block drafter checkpoint (its config, draft vocabulary and feature statistics) "
                        "instead of random weights")
    p.add_argument("--draft-vocab", type=int, default=4096, help="size of the draft vocabulary (the head's rows)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=2.0, help="position weight exp(-(i-1)/gamma)")
    p.add_argument("--reveal-prob", type=float, default=0.2, help="share of blocks that see part of their answer")
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-seqs", type=int, default=256, help="held-out answers the tau estimate uses (8 anchors each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return p


def training_prompts(args, verifier, tokenizer) -> tuple[list[str], str]:
    """The prompts the verifier answers, and the name of the folder their answers go to."""
    prompts = chat_prompts(args.seed)
    if not args.synthetic_prompts:
        # The name the CPU recipe has always used, so its cached answers stay valid.
        return prompts, "generated" if args.gen_batch == 64 else f"generated-b{args.gen_batch}"
    synthetic = synthetic_user_turns(verifier, tokenizer, args.synthetic_prompts,
                                     args.work_dir / f"synthetic-prompts-{args.synthetic_prompts}-s{args.seed}.json",
                                     batch_size=args.gen_batch, seed=args.seed)
    return interleave(prompts, synthetic), f"generated-b{args.gen_batch}-syn{args.synthetic_prompts}"


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.block_size < 2:
        parser().error("--block-size must be >= 2")
    if args.init_from and args.arch != "block":
        parser().error("--init-from starts a block drafter from a checkpoint: use it with --arch block")
    if args.threads:
        torch.set_num_threads(args.threads)
    from hybrid.default import load_verifier

    verifier, tokenizer = load_verifier(args.device)
    verifier.requires_grad_(False)
    t_start = time.time()
    # 1. generate
    prompts, gen_name = training_prompts(args, verifier, tokenizer)
    gen_dir = args.work_dir / gen_name
    max_shards = None if args.gen_shards < 0 else args.gen_shards
    generate_shards(verifier, tokenizer, prompts, gen_dir, minutes=float("inf") if args.gen_minutes is None else args.gen_minutes,
                    batch_size=args.gen_batch, max_shards=max_shards)
    shards = len(sorted(gen_dir.glob("gen-*.json"))[:max_shards])
    # 2. features (the folder name says what they depend on)
    layers = tuple(BlockDiffusionConfig.for_verifier(verifier).target_layers)
    data = f"g{shards}" if gen_name == "generated" else f"{gen_name.removeprefix('generated-')}-g{shards}"
    feature_dir = args.work_dir / f"features-{data}-d{args.doc_tokens}-l{'_'.join(map(str, layers))}"
    if not (feature_dir / "meta.json").exists():
        sequences = load_sequences(gen_dir, tokenizer, args.doc_tokens, max_shards=shards)
        build_features(verifier, sequences, feature_dir, layers, batch_tokens=args.feature_batch_tokens)
    # 3. train
    out = args.out or args.work_dir / f"{args.arch}-drafter"
    run_dir = args.work_dir / f"train-{args.arch}-{feature_dir.name}-{recipe_tag(args)}"
    summary = train(args, verifier, FeatureStore(feature_dir), out, run_dir)
    summary["command_wall_minutes_this_run"] = round((time.time() - t_start) / 60, 1)
    print(f"done: {summary}; drafter in {out}")


def recipe_tag(args) -> str:
    """A short hash of what shapes the training run, so a resume never continues a different recipe."""
    import hashlib

    keys = ("arch", "seqs_per_step", "anchors_per_seq", "block_size", "layers", "draft_vocab", "lr", "gamma",
            "reveal_prob", "seed")
    values = [getattr(args, k) for k in keys] + [str(args.init_from)]
    return f"s{args.seed}-" + hashlib.sha256(json.dumps(values).encode()).hexdigest()[:8]


def initial_block_model(args, verifier, store: FeatureStore, train_ids: list[int]) -> BlockDiffusionModel:
    """The block model training starts from: `--init-from`'s checkpoint, or fresh weights with a draft vocabulary
    and feature statistics taken from the training answers. (The AR baseline takes its trainable budget from it.)"""
    start = args.init_from and args.arch == "block"
    if start:
        model = load_model(args.init_from).float()
        check_fingerprint(model.config.verifier, verifier_fingerprint(verifier))
        config = model.config
    else:
        config = BlockDiffusionConfig.for_verifier(verifier, num_layers=args.layers, block_size=args.block_size,
                                                   draft_vocab_size=args.draft_vocab)
    if tuple(store.layers) != tuple(config.target_layers):
        raise ValueError(f"features hold layers {store.layers}, the drafter needs {config.target_layers}: rebuild them")
    if start:
        return model
    vocab, coverage = draft_vocabulary(store, train_ids, args.draft_vocab)
    print(f"draft vocabulary: {len(vocab)} tokens cover {coverage:.1%} of the verifier's greedy answer tokens")
    config.draft_vocab_size = len(vocab)
    torch.manual_seed(args.seed)
    model = BlockDiffusionModel(config)
    model.draft_vocab.copy_(vocab)
    embedding_std = float(verifier.get_input_embeddings().weight.detach().std())
    model.mask_embedding.data.normal_(std=embedding_std)
    model.feature_gate.data.fill_(embedding_std)  # fused features have unit RMS: start them at the embeddings' scale
    shift, scale = feature_statistics(store, train_ids, args.seed)
    model.feature_shift.copy_(shift)
    model.feature_scale.copy_(scale)
    return model


def train(args, verifier, store: FeatureStore, out: Path, run_dir: Path) -> dict:
    """Stage 3: train (or resume) `args.arch` on `store`; export the drafter to `out`; return a summary."""
    device = verifier.device
    train_ids, held = split(store)
    answer_tokens = sum(int(store.offsets[i + 1] - store.offsets[i] - store.prompt_lens[i]) for i in train_ids)
    print(f"data: {len(train_ids)} training sequences ({answer_tokens} answer tokens), {len(held)} held out")
    block_model = initial_block_model(args, verifier, store, train_ids)
    config = block_model.config
    vocab = block_model.draft_vocab.clone()
    vmap = VocabMap(vocab, verifier.get_input_embeddings().weight.shape[0])
    if device.type != "cpu" and args.arch == "block":
        store.move_hidden(device)
    embed, head = frozen_verifier_parts(verifier, vocab)
    if args.arch == "block":
        model = block_model
    else:
        model = make_ar_model(verifier, sum(p.numel() for p in trainable(block_model)))
    model.to(device)
    final_norm = getattr(verifier.base_model, "norm", None)
    if final_norm is not None and not args.init_from:  # start the output norm where the verifier's is, so its frozen head reads it
        (model.norm if args.arch == "block" else model.model.norm).weight.data.copy_(final_norm.weight.data)
    params = trainable(model)
    print(f"{args.arch} drafter: {sum(p.numel() for p in params) / 1e6:.2f} M trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = run_dir / "checkpoint.pt", run_dir / "log.jsonl"
    step, elapsed, planned = 0, 0.0, args.steps
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
        if args.minutes is not None:  # the step count --minutes fixed when the run began
            planned = state.get("planned_steps", args.steps)
        print(f"resumed at step {step} of {planned} ({elapsed / 60:.1f} min of training so far)")
    sizing = args.minutes is not None and step < 10  # --minutes: the step count is fixed once, after step 10
    anchors = held_out_anchors(store, held[: args.eval_seqs], per_seq=8, seed=args.seed)
    if not anchors:
        raise ValueError("no held-out anchors (answers on the verifier's greedy chain): generate more data")
    print(f"held-out: {sum(len(a) for _, a in anchors)} anchors; prompt lookup tau there "
          f"{lookup_tau(store, anchors, config.block_size):.2f}")
    weights = position_weights(config.block_size, args.gamma).to(device)
    record = {}
    model.train()
    interactive = sys.stderr.isatty()
    bar = tqdm(total=planned, initial=step, desc=f"train {args.arch}", dynamic_ncols=True, mininterval=0.1 if interactive else 30)
    t0 = time.time() - elapsed
    while step < planned:
        rng = np.random.default_rng([args.seed, step])  # batches depend on (seed, step) only: resuming is exact
        seqs = rng.choice(train_ids, size=min(args.seqs_per_step, len(train_ids)), replace=False)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, planned, args.lr)
        if args.arch == "block":
            batch = to_device(block_batch(store, seqs, rng, args.anchors_per_seq, config.block_size, vmap, args.reveal_prob), device)
            logits = block_forward(model, embed, head, batch)
            w = batch["loss_mask"] * weights
        else:
            batch = to_device(ar_batch(store, seqs, vmap), device)
            logits = ar_forward(model, head, batch)
            w = batch["loss_mask"].float()
        k = store.top_k
        loss = distill_loss(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1),
                            batch["soft_ids"].reshape(-1, k), batch["soft_probs"].reshape(-1, k), w.reshape(-1).float())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        if sizing and step == 10:
            # Warm-up lasts 50 steps, so the first 10 followed the same schedule whatever the total: the run equals
            # a `--steps planned` run.
            per_step = (time.time() - t0) / step
            planned = max(step + 1, int(args.minutes * 60 / per_step))
            bar.total = planned
            tqdm.write(f"--minutes {args.minutes}: {per_step:.3f} s/step, so {planned} steps")
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **({"tau": record["tau"]} if record else {}))
        evaluated = step % args.eval_every == 0 or step == planned
        if evaluated:
            tau, by_pos = estimate_tau(args.arch, model, embed, head, store, anchors, vmap, vocab, config.block_size,
                                       device, chunk_size=max(4, args.seqs_per_step))
            record = {"tau": round(tau, 3), "accept_by_position": [round(float(x), 3) for x in by_pos]}
            export(args.arch, model, out)
            tqdm.write(f"step {step}: loss {loss.item():.3f}, held-out tau {tau:.2f}, accept by position "
                       f"{record['accept_by_position'][:8]}")
        if step % args.save_every == 0 or evaluated:
            elapsed = time.time() - t0
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "elapsed": elapsed, "planned_steps": planned}, tmp)
            tmp.rename(ckpt_path)
            with log_path.open("a") as f:
                f.write(json.dumps({"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(elapsed),
                                    **(record if evaluated else {})}) + "\n")
    bar.close()
    summary = {"arch": args.arch, "steps": step, "train_minutes": round((time.time() - t0) / 60, 1),
               "answer_tokens": answer_tokens, "sequences": len(train_ids), "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "threads": torch.get_num_threads(), "command": "python -m drafters.train " + " ".join(sys.argv[1:]), **record}
    if out.exists():
        (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def export(arch: str, model, out: Path) -> None:
    """The drafter's weights, stored in bfloat16 (half the size; loading casts them to the model's dtype)."""
    if arch == "block":
        save_model(model, out, dtype=torch.bfloat16)
    else:
        save_ar_model(model, out, dtype=torch.bfloat16)


if __name__ == "__main__":
    main()
