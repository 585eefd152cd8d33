"""Training drafters for a verifier by self-distillation: a pipeline that nothing at run time imports.

    python -m drafters.training.train         # the block-diffusion drafter (--arch ar / dflash: the others)
    python -m drafters.training.ngram_build   # the n-gram store, from the same training answers

`corpus.py` (offline prompts and texts), `distill.py` (the verifier's answers, their features, the held-out
split), `batches.py` (anchors, block targets, the tensors of a step), `losses.py` (the distillation loss),
`models.py` (how the trained models start, their forward over a batch, their export), `dflash.py` (`--arch
dflash`: z-lab's DFlash architecture on the same data), `estimate.py` (the held-out tau estimate), `parallel.py`
(the processes of a data-parallel run), `train.py` (the command: arguments and the loop), `ngram_build.py` (the
store's command). What the trained files are loaded by (drafters.block_diffusion, drafters.dflash,
drafters.ar_baseline, drafters.ngram_store) lives outside this package.
"""
