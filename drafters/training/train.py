"""Train a drafter for a verifier by self-distillation, fully offline, resumable at every stage.

    python -m drafters.training.train              # the CPU recipe: block-diffusion drafter, ~55 min on 2 cores
    python -m drafters.training.train --arch ar    # the 1-layer AR baseline, same data and trainable budget
    python -m drafters.training.train --arch dflash  # z-lab's DFlash architecture, same data; exports a DFlash folder
    python -m drafters.training.train --verifier DIR --prompts FILE.jsonl  # a drafter for any causal LM
    accelerate launch --multi_gpu --num_processes N -m drafters.training.train ...  # data-parallel (training.parallel)
    bash experiments/gpu_train.sh OUT              # the GPU recipe of the shipped checkpoint (these options, scaled)

The shipped checkpoint (drafters/checkpoints/smollm2-135m-block) is the GPU recipe's (smollm2-135m-block-gpu) trained
on with this command on 2 cores (`--init-from`); each one's training.json records its command and what it cost.
Drafters go to WORK/{block,ar,dflash}-drafter unless --out says otherwise, where WORK is --work-dir for the embedded
verifier and --work-dir/verifiers/ARCHITECTURE-KEY for any other (`verifier_work_dir`: the key is its fingerprint's,
so no verifier reuses another's answers or features); copy a block drafter into drafters/checkpoints/ to ship it. A dflash drafter is a DFlash folder that vLLM and SGLang
serve as it is (README).

Stages, each cached under WORK (a rerun skips what is done; delete a folder to redo it):
  1. generate  the verifier answers --gen-shards x --gen-batch training prompts greedily (drafters.training.corpus,
               plus --synthetic-prompts user turns sampled from the verifier);
  2. features  one teacher-forced verifier pass over those answers and --doc-tokens of local documents
               records the fused hidden states, greedy targets and top-k soft labels (drafters.training.distill;
               progress saved every minute, an interrupted pass resumes where it was);
  3. train     --steps optimizer steps; a checkpoint every --save-every steps (resumed automatically),
               a held-out acceptance estimate (tau of one-pass greedy drafting) every --eval-every steps
               (batches, losses, models and the estimate are drafters.training's other modules).
Seeded: the same command on the same data gives the same batches, resumed or not.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import broadcast_object_list
from tqdm import tqdm

from drafters.block_diffusion import (
    CONFIG_NAME,
    MASKED_INPUTS,
    BlockDiffusionConfig,
    frozen_verifier_parts,
    load_model,
    verifier_fingerprint,
)
from drafters.training.batches import REVEAL_SCHEMES, VocabMap, ar_batch, block_batch, to_device
from drafters.training.corpus import chat_prompts, prompt_file
from drafters.training.dflash import dflash_layers, initial_dflash_model
from drafters.training.distill import (
    MAX_ANSWER_TOKENS,
    FeatureStore,
    answers_suffix,
    build_features,
    generate_shards,
    interleave,
    load_sequences,
    split,
    synthetic_answers_name,
    synthetic_turns_name,
    synthetic_user_turns,
)
from drafters.training.estimate import ScoringSettings, estimate_tau, held_out_anchors, lookup_tau
from drafters.training.losses import distill_loss, keep_loss, position_weights
from drafters.training.models import (
    StepLogits,
    block_forward,
    export,
    final_norm,
    initial_block_model,
    make_ar_model,
    trainable,
)
from drafters.training.parallel import step_share, training_accelerator
from verifiers.embedded import cache_dir, load_verifier

DEFAULT_WORK_DIR = cache_dir() / "drafter"  # $HYBRID_CACHE/drafter, else ~/.cache/hybrid/drafter
SHIPPED_DRAFTER = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-block"  # the embedded verifier's


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m drafters.training.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--arch",
        choices=("block", "ar", "dflash"),
        default="block",
        help="block-diffusion drafter, the 1-layer AR baseline, or a drafter in z-lab's DFlash architecture",
    )
    add_generation_arguments(p)
    p.add_argument("--out", type=Path, default=None, help="where the trained drafter goes (default: WORK/ARCH-drafter)")
    p.add_argument("--doc-tokens", type=int, default=30_000, help="tokens of local documents (stdlib, pydoc) to add")
    p.add_argument(
        "--feature-batch-tokens", type=int, default=4096, help="tokens per verifier pass in the features stage"
    )
    p.add_argument(
        "--feature-dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="the verifier's dtype for the features stage alone (default: --dtype). bfloat16 records features several "
        "times faster on a CPU with bfloat16 matrix units, from the same float32 answers; the features are stored in "
        "float16 either way",
    )
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="set --steps from the step time measured over the first 10 steps so training takes about this long",
    )
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--anchors-per-seq", type=int, default=96)
    p.add_argument("--block-size", type=int, default=8, help="positions per block, anchor included")
    p.add_argument("--layers", type=int, default=1, help="drafter layers (block and dflash archs)")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this block drafter checkpoint (its config, draft vocabulary and feature statistics) "
        "instead of random weights",
    )
    p.add_argument(
        "--masked-input",
        choices=MASKED_INPUTS,
        default=None,
        help="what a masked block position reads (BlockDiffusionConfig.masked_input; default: nearest_known for a new "
        "drafter, the checkpoint's own with --init-from)",
    )
    p.add_argument("--draft-vocab", type=int, default=4096, help="size of the draft vocabulary (the head's rows)")
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="--arch dflash: the token whose verifier embedding marks a masked position (default: the least used one)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=2.0, help="position weight exp(-(i-1)/gamma)")
    p.add_argument("--reveal-prob", type=float, default=0.5, help="share of blocks that see part of their answer")
    p.add_argument(
        "--reveal-scheme",
        choices=REVEAL_SCHEMES,
        default="prefix",
        help="what a revealed block sees: a leading run of its answer (as at draft time), or half of the time a "
        "random subset (mixed)",
    )
    p.add_argument(
        "--keep-weight",
        type=float,
        default=0.0,
        help="with --init-from: on blocks given no token, also match the starting checkpoint's distribution, with "
        "this weight (0: off), so that a fine-tune on little data keeps what the checkpoint drafts from the anchor",
    )
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-seqs", type=int, default=256, help="held-out answers the tau estimate uses (8 anchors each)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return p


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the verifier and of the generate stage (drafters.training.ngram_build reads the same answers)."""
    p.add_argument(
        "--verifier",
        default=None,
        help="the verifier to train for: a transformers causal-LM folder (or a hub name, where a hub is reachable), "
        "loaded with AutoModelForCausalLM and AutoTokenizer in --dtype (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the verifier's dtype for its answers and features (the drafter trains in float32 either way)",
    )
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="cache of generated data and features")
    p.add_argument("--device", default="cpu", help="torch device for the verifier and the drafter (cpu, cuda, ...)")
    p.add_argument(
        "--gen-shards",
        type=int,
        default=13,
        help="batches of --gen-batch training prompts the verifier answers (-1: all of them)",
    )
    p.add_argument("--gen-batch", type=int, default=64, help="prompts per generation batch (and shard)")
    p.add_argument(
        "--gen-minutes", type=float, default=None, help="stop generating after this long (no limit by default)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=MAX_ANSWER_TOKENS, help="the longest answer the verifier gives a prompt"
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help='a .jsonl file of {"prompt": ...} user turns the verifier answers instead of the templated ones '
        "(e.g. `python -m drafters.training.answer_sets fresh`)",
    )
    p.add_argument(
        "--synthetic-prompts",
        type=int,
        default=0,
        help="user turns sampled from the verifier (after its chat template's user header), added to the templated "
        "prompts",
    )
    p.add_argument("--seed", type=int, default=0)


def load_training_verifier(args) -> tuple:
    """(verifier, tokenizer, WORK): --verifier (a folder, or a hub name passed through to from_pretrained) or the
    embedded default, frozen, in --dtype on --device; WORK is the folder under --work-dir its cached stages go to."""
    dtype = getattr(torch, args.dtype)
    if args.verifier is None:
        verifier, tokenizer = load_verifier(args.device, dtype=dtype)
    else:
        from verifiers.pretrained import load_verifier_folder

        try:
            verifier, tokenizer = load_verifier_folder(args.verifier, args.device, dtype=dtype, hub=True)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    verifier.requires_grad_(False)
    return verifier, tokenizer, verifier_work_dir(args.work_dir, verifier_fingerprint(verifier))


def verifier_work_dir(work_dir: Path, fingerprint: dict) -> Path:
    """Where a verifier's answers, features and runs are cached: --work-dir itself for the embedded verifier (the
    folders the recipes and experiments.heldout read), else a folder keyed by the verifier's fingerprint, so the same
    weights get the same folder however they were given, and another verifier never reads their answers."""
    shipped = json.loads((SHIPPED_DRAFTER / CONFIG_NAME).read_text())["verifier"]  # the embedded verifier's
    if fingerprint == shipped:
        return work_dir
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    return work_dir / "verifiers" / f"{fingerprint['architecture']}-{key}"


def training_prompts(args, verifier, tokenizer, work: Path) -> tuple[list[str], str]:
    """The prompts the verifier answers, and the name of the folder their answers go to (named by what they depend on:
    float32 answers keep the names they have always had)."""
    length = answers_suffix(args.max_new_tokens, args.dtype)
    if args.prompts is not None:
        prompts = prompt_file(args.prompts)
        digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:8]
        return prompts, f"generated-{args.prompts.stem}-{digest}-b{args.gen_batch}{length}"
    prompts = chat_prompts(args.seed)
    if not args.synthetic_prompts:
        # The name the CPU recipe has always used, so its cached answers stay valid.
        return prompts, "generated" + length if args.gen_batch == 64 else f"generated-b{args.gen_batch}{length}"
    synthetic = synthetic_user_turns(
        verifier,
        tokenizer,
        args.synthetic_prompts,
        work / synthetic_turns_name(args.synthetic_prompts, args.seed, args.dtype),
        batch_size=args.gen_batch,
        seed=args.seed,
    )
    return interleave(prompts, synthetic), synthetic_answers_name(
        args.gen_batch, args.synthetic_prompts, args.max_new_tokens, args.dtype
    )


def generate_stage(args, verifier, tokenizer, work: Path) -> tuple[Path, int]:
    """Stage 1: the verifier's answers to the training prompts (resumed where a run stopped); (their folder, shards)."""
    prompts, gen_name = training_prompts(args, verifier, tokenizer, work)
    gen_dir = work / gen_name
    max_shards = None if args.gen_shards < 0 else args.gen_shards
    generate_shards(
        verifier,
        tokenizer,
        prompts,
        gen_dir,
        minutes=float("inf") if args.gen_minutes is None else args.gen_minutes,
        batch_size=args.gen_batch,
        max_new_tokens=args.max_new_tokens,
        max_shards=max_shards,
    )
    return gen_dir, len(sorted(gen_dir.glob("gen-*.json"))[:max_shards])


def check_generation_arguments(p: argparse.ArgumentParser, args) -> None:
    if args.prompts is not None and args.synthetic_prompts:
        p.error("--prompts replaces the templated prompts: give it without --synthetic-prompts")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.block_size < 2:
        parser().error("--block-size must be >= 2")
    check_generation_arguments(parser(), args)
    if args.init_from and args.arch != "block":
        parser().error("--init-from starts a block drafter from a checkpoint: use it with --arch block")
    if args.keep_weight < 0 or (args.keep_weight and not args.init_from):
        parser().error("--keep-weight is a weight >= 0 on matching the --init-from checkpoint: give --init-from too")
    if args.threads:
        torch.set_num_threads(args.threads)
    accelerator = training_accelerator(args.device)
    if accelerator.num_processes > 1:
        args.device = str(accelerator.device)  # each process on its own (its GPU, or the CPU)
    verifier, tokenizer, work = load_training_verifier(args)
    accelerator.print(f"verifier: {type(verifier).__name__} in {verifier.dtype}; cached stages in {work}")
    t_start = time.time()
    # 1-2. The main process generates and records features alone (one set of shard files, one feature store, as one
    # process writes them); the others wait here for the folder it names.
    feature_dir = data_stages(args, verifier, tokenizer, work) if accelerator.is_main_process else None
    feature_dir = broadcast_object_list([feature_dir])[0]
    # 3. train
    out = args.out or work / f"{args.arch}-drafter"
    run_dir = work / f"train-{args.arch}-{feature_dir.name}-{recipe_tag(args)}"
    summary = train(args, verifier, FeatureStore(feature_dir), out, run_dir, accelerator)
    summary["command_wall_minutes_this_run"] = round((time.time() - t_start) / 60, 1)
    accelerator.print(f"done: {summary}; drafter in {out}")
    accelerator.end_training()  # closes the process group now: torn down at exit, gloo can abort a worker


def data_stages(args, verifier, tokenizer, work: Path) -> Path:
    """Stages 1 and 2: the verifier's answers, then their features (the folder's name says what they depend on; a
    DFlash drafter reads layers before the last); the feature folder."""
    gen_dir, shards = generate_stage(args, verifier, tokenizer, work)
    if args.arch == "dflash":
        layers = dflash_layers(verifier)
    else:
        layers = tuple(BlockDiffusionConfig.for_verifier(verifier).target_layers)
    gen_name = gen_dir.name
    data = f"g{shards}" if gen_name == "generated" else f"{gen_name.removeprefix('generated-')}-g{shards}"
    dtype = feature_dtype(args)
    # Named by their dtype where it is not the answers' (whose folder name already carries theirs).
    suffix = "" if dtype == args.dtype else f"-{dtype}"
    feature_dir = work / f"features-{data}-d{args.doc_tokens}-l{'_'.join(map(str, layers))}{suffix}"
    if not (feature_dir / "meta.json").exists():
        sequences = load_sequences(gen_dir, tokenizer, args.doc_tokens, max_shards=shards)
        # A copy in the features' dtype: the answers above and the training below keep the verifier's own.
        teacher = verifier if dtype == args.dtype else copy.deepcopy(verifier).to(getattr(torch, dtype))
        build_features(teacher, sequences, feature_dir, layers, batch_tokens=args.feature_batch_tokens)
    return feature_dir


def feature_dtype(args) -> str:
    """The verifier's dtype in the features stage: --feature-dtype, else the verifier's own (--dtype)."""
    return args.feature_dtype or args.dtype


def recipe_tag(args) -> str:
    """A short hash of what shapes the training run, so a resume never continues a different recipe (the step plan
    included: it sets the learning-rate schedule, so a longer run is another run, not a continued one)."""
    keys = (
        "arch",
        "steps",
        "minutes",
        "seqs_per_step",
        "anchors_per_seq",
        "block_size",
        "layers",
        "draft_vocab",
        "lr",
        "gamma",
        "reveal_prob",
        "reveal_scheme",
        "masked_input",
        "seed",
    )
    values = [getattr(args, k) for k in keys] + [str(args.init_from)]
    if args.arch == "dflash":
        values.append(args.mask_token_id)
    if args.keep_weight:
        values.append(args.keep_weight)
    return f"s{args.seed}-" + hashlib.sha256(json.dumps(values).encode()).hexdigest()[:8]


def train(args, verifier, store: FeatureStore, out: Path, run_dir: Path, accelerator=None) -> dict:
    """Stage 3: train (or resume) `args.arch` on `store`; export the drafter to `out`; return a summary.

    Data-parallel under `accelerator` (drafters.training.parallel): each process trains on its share of every step's
    sequences, and only the main one evaluates, writes checkpoints and logs, and exports."""
    accelerator = accelerator or training_accelerator(args.device)
    main_process, processes, print_ = accelerator.is_main_process, accelerator.num_processes, accelerator.print
    device = verifier.device
    train_ids, held = split(store)
    if min(args.seqs_per_step, len(train_ids)) < processes:
        raise ValueError(
            f"--seqs-per-step {args.seqs_per_step} ({len(train_ids)} training sequences) gives {processes} processes "
            f"less than one sequence each a step: give at least {processes}"
        )
    answer_tokens = sum(int(store.offsets[i + 1] - store.offsets[i] - store.prompt_lens[i]) for i in train_ids)
    print_(f"data: {len(train_ids)} training sequences ({answer_tokens} answer tokens), {len(held)} held out")
    vocab_size = verifier.get_input_embeddings().weight.shape[0]
    if args.arch == "dflash":  # the whole vocabulary, as the verifier's head scores it
        model = initial_dflash_model(args, verifier, store)
        vocab, block_size = torch.arange(vocab_size), model.block_size
    else:
        block_model = initial_block_model(args, verifier, store, train_ids)
        vocab, block_size = block_model.draft_vocab.clone(), block_model.config.block_size
        if args.arch == "block":
            model = block_model
        else:
            model = make_ar_model(verifier, sum(p.numel() for p in trainable(block_model)))
    vmap = VocabMap(vocab, vocab_size)
    if device.type != "cpu" and args.arch != "ar":
        store.move_hidden(device)
    embed, head = frozen_verifier_parts(verifier, vocab)
    if embed.weight.dtype != torch.float32:  # --dtype: the drafter trains in float32, on float32 copies of them
        embed, head = torch.nn.Embedding.from_pretrained(embed.weight.float(), freeze=True), head.float()
    model.to(device)
    norm = final_norm(verifier)
    if norm is not None and not args.init_from:  # start the output norm where the verifier's is, so its head reads it
        (model.model.norm if args.arch == "ar" else model.norm).weight.data.copy_(norm.weight.data)
    params = trainable(model)
    # --keep-weight: the checkpoint training started from, frozen, as it drafts a block given nothing.
    keep_from = load_model(args.init_from).float().to(device).eval().requires_grad_(False) if args.keep_weight else None
    print_(f"{args.arch} drafter: {sum(p.numel() for p in params) / 1e6:.2f} M trainable parameters")
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
        print_(f"resumed at step {step} of {planned} ({elapsed / 60:.1f} min of training so far)")
    sizing = args.minutes is not None and step < 10  # --minutes: the step count is fixed once, after step 10
    anchors = held_out_anchors(store, held[: args.eval_seqs], per_seq=8, seed=args.seed)
    if not anchors:
        raise ValueError("no held-out anchors (answers on the verifier's greedy chain): generate more data")
    print_(
        f"held-out: {sum(len(a) for _, a in anchors)} anchors; prompt lookup tau there "
        f"{lookup_tau(store, anchors, block_size):.2f}"
    )
    scoring = ScoringSettings(
        model,
        embed,
        head,
        vocab,
        vmap,
        block_size,
        store,
        anchors,
        arch="ar" if args.arch == "ar" else "block",  # a DFlash drafter drafts a block as the block drafter does
        device=device,
        chunk_size=max(4, args.seqs_per_step),
    )
    # DDP (more than one process) wraps the whole step's forward; `model` stays the drafter itself, for the estimate,
    # the checkpoints and the export.
    step_logits, optimizer = accelerator.prepare(StepLogits(args.arch, model, embed, head), optimizer)
    record = {}
    model.train()
    interactive = sys.stderr.isatty()
    bar = tqdm(
        total=planned,
        initial=step,
        desc=f"train {args.arch}",
        dynamic_ncols=True,
        mininterval=0.1 if interactive else 30,
        disable=not main_process,
    )
    t0 = time.time() - elapsed
    while step < planned:
        rng = np.random.default_rng([args.seed, step])  # batches depend on (seed, step) only: resuming is exact
        seqs = rng.choice(train_ids, size=min(args.seqs_per_step, len(train_ids)), replace=False)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, planned, args.lr)
        # Every process builds the whole step's batch from the same generator and trains on its rows, so N processes
        # take the step one process takes (the same sequences, anchors and reveals; the loss divided by the whole
        # step's weight, times N since DDP averages the processes' gradients).
        if args.arch != "ar":  # both block drafters train on the same blocks
            batch = to_device(
                block_batch(
                    store, seqs, rng, args.anchors_per_seq, block_size, vmap, args.reveal_prob, None, args.reveal_scheme
                ),
                device,
            )
            w = batch["loss_mask"] * position_weights(block_size, args.gamma, batch["first_masked"])
        else:
            batch = to_device(ar_batch(store, seqs, vmap), device)
            w = batch["loss_mask"].float()
        total = w.float().sum()
        batch = step_share(batch | {"weights": w}, accelerator.process_index, processes)
        w = batch.pop("weights")
        logits = step_logits(batch)
        k = store.top_k
        loss = distill_loss(
            logits.reshape(-1, logits.shape[-1]),
            batch["targets"].reshape(-1),
            batch["soft_ids"].reshape(-1, k),
            batch["soft_probs"].reshape(-1, k),
            w.reshape(-1).float(),
            total=total,
        )
        if keep_from is not None:
            # Blocks given no token read the same inputs in the checkpoint and the drafter, whatever the masked
            # positions read: there the checkpoint's distribution is the target too.
            with torch.no_grad():
                kept = block_forward(keep_from, embed, head, batch)
            given_nothing = ~batch["known"][..., 1:].any(-1, keepdim=True)
            keep = keep_loss(logits, kept, (w * given_nothing).float(), total)
            loss = loss + args.keep_weight * keep
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss * processes)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        loss = accelerator.reduce(loss.detach(), reduction="sum")  # the step's loss, as one process computes it
        step += 1
        if sizing and step == 10:
            # Warm-up lasts 50 steps, so the first 10 followed the same schedule whatever the total: the run equals
            # a `--steps planned` run. Every process takes the main one's count.
            per_step = (time.time() - t0) / step
            planned = broadcast_object_list([max(step + 1, int(args.minutes * 60 / per_step))])[0]
            bar.total = planned
            if main_process:
                tqdm.write(f"--minutes {args.minutes}: {per_step:.3f} s/step, so {planned} steps")
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **({"tau": record["tau"]} if record else {}))
        evaluated = step % args.eval_every == 0 or step == planned
        if not main_process:
            continue
        if evaluated:
            tau, by_pos = estimate_tau(scoring)
            record = {"tau": round(tau, 3), "accept_by_position": [round(float(x), 3) for x in by_pos]}
            export(args.arch, model, out)
            tqdm.write(
                f"step {step}: loss {loss.item():.3f}, held-out tau {tau:.2f}, accept by position "
                f"{record['accept_by_position'][:8]}"
            )
        if step % args.save_every == 0 or evaluated:
            elapsed = time.time() - t0
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "elapsed": elapsed,
                    "planned_steps": planned,
                },
                tmp,
            )
            tmp.rename(ckpt_path)
            with log_path.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "loss": round(loss.item(), 4),
                            "elapsed_s": round(elapsed),
                            **(record if evaluated else {}),
                        }
                    )
                    + "\n"
                )
    bar.close()
    summary = {
        "arch": args.arch,
        "steps": step,
        "train_minutes": round((time.time() - t0) / 60, 1),
        "answer_tokens": answer_tokens,
        "sequences": len(train_ids),
        "device": str(device),
        "verifier_dtype": str(verifier.dtype).removeprefix("torch."),
        "feature_dtype": feature_dtype(args),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "command": "python -m drafters.training.train " + " ".join(sys.argv[1:]),
        **record,
    }
    if main_process and out.exists():
        (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    """Linear warm-up, then cosine to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


if __name__ == "__main__":
    main()
