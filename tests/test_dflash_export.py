"""A DFlash folder hybrid writes is deployable: it carries its model code and `auto_map`, so z-lab's documented
`AutoModel.from_pretrained(folder, trust_remote_code=True)` loads it offline, with the weight names and shapes of
hybrid's drafter and the same forward; its `spec_generate` decodes as the target's greedy `generate`, a Qwen3.5 or
Jamba target's recurrent layers rolled back to the accepted prefix's state; and hybrid reads its own exports and
z-lab's folders as before. The folder's model code is the file that defines hybrid's DFlash model, so it imports
nothing of hybrid."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
from test_dflash import TARGETS, VARIANTS, tiny_target, write_dflash_folder
from transformers import AutoModel, DynamicCache

from drafters import DFlashDrafter, dflash_model
from drafters.dflash import read_config
from drafters.dflash_model import layer_kind, layer_masks
from hybrid.testing import tiny_model

VOCAB = 64


def target(arch: str):
    """A tiny target of `TARGETS`, or Jamba (a Mamba layer, then an attention layer), or Mistral with a sliding window
    of 3 (whose cache drops the keys that fall out of it, and a rollback must bring back)."""
    if arch == "mistral":
        return tiny_model(arch, VOCAB, 2, seed=1, sliding_window=3)
    return tiny_target(arch) if arch in TARGETS else tiny_model(arch, VOCAB, 1, seed=1)


def exported(tmp_path: Path, arch: str, variant: str):
    """(verifier, hybrid's drafter, the reference-call model) for a z-lab-format folder re-saved by hybrid."""
    verifier = target(arch)
    source = write_dflash_folder(tmp_path / "zlab", verifier, variant=variant)
    drafter = DFlashDrafter.from_pretrained(source, verifier, dtype=torch.float32)
    drafter.save_pretrained(tmp_path / "export", dtype=torch.float32)
    sys.modules.pop("transformers_modules", None)  # each folder's own code, not a cached earlier one
    loaded = AutoModel.from_pretrained(tmp_path / "export", trust_remote_code=True).eval()
    return verifier, drafter, loaded


def hybrid_forward(drafter: DFlashDrafter, target_hidden, noise, positions) -> torch.Tensor:
    """hybrid's drafter on [context ; block] from scratch: context keys/values, then the block under each layer's
    mask."""
    model, n = drafter.model, target_hidden.shape[1]
    context = model.context(target_hidden, positions[:, :n])
    masks = layer_masks(model.kinds, positions[:, n:], positions, None)
    return model(noise, positions[:, n:], context, masks)


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_reference_call_loads_hybrids_folder_and_drafts_as_hybrid(tmp_path, arch, variant):
    verifier, drafter, loaded = exported(tmp_path, arch, variant)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (
        config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"} and type(loaded).__name__ == "DFlashDraftModel"
    )
    mine = {k: tuple(v.shape) for k, v in drafter.model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in loaded.state_dict().items()} == mine
    for name, weight in drafter.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], weight, rtol=0, atol=0, msg=name)
    assert loaded.target_layer_ids == list(drafter.model.target_layer_ids)
    assert (loaded.mask_token_id, loaded.block_size) == (drafter.model.mask_token_id, drafter.model.block_size)

    gen = torch.Generator().manual_seed(0)
    n, block, h = 9, drafter.block_size, verifier.config.hidden_size
    target_hidden = torch.randn(1, n, 2 * h, generator=gen)
    noise = torch.randn(1, block, h, generator=gen)
    positions = torch.arange(n + block)[None]
    expected = hybrid_forward(drafter, target_hidden, noise, positions)
    with torch.no_grad():
        whole = loaded(positions, noise_embedding=noise, target_hidden=target_hidden)
        torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
        # The reference's way: the context in pieces through a cache, the block cropped off after each draft.
        cache = DynamicCache()
        loaded(
            positions[:, : 4 + block],
            noise_embedding=noise,
            target_hidden=target_hidden[:, :4],
            past_key_values=cache,
            use_cache=True,
        )
        cache.crop(-block)
        pieces = loaded(
            positions[:, 4:],
            noise_embedding=noise,
            target_hidden=target_hidden[:, 4:],
            past_key_values=cache,
            use_cache=True,
        )
    torch.testing.assert_close(pieces, expected, atol=1e-5, rtol=1e-5)


# Jamba: Mamba layers (conv and SSM state) under attention layers, which spec_generate rolls back the same way.
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "jamba"])
def test_spec_generate_of_the_loaded_folder_is_the_targets_greedy_output(tmp_path, arch, one_thread):
    """z-lab's documented use of the loaded drafter: `draft.spec_generate(target=..., ...)` decodes losslessly."""
    verifier, _, loaded = exported(tmp_path, arch, "sliding")
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4]])
    expected = verifier.generate(prompt, max_new_tokens=20, do_sample=False)
    out = loaded.spec_generate(target=verifier, input_ids=prompt, max_new_tokens=20, temperature=0.0)
    assert out.tolist() == expected.tolist()
    stop = int(expected[0, prompt.shape[1] + 5])
    stopped = loaded.spec_generate(verifier, prompt, max_new_tokens=20, stop_token_ids=[stop])
    assert stopped[0, -1] == stop and stopped[0].tolist() == expected[0, : stopped.shape[1]].tolist()


class AcceptSchedule(torch.nn.Module):
    """A drafting head for `spec_generate` that drafts the target's own greedy tokens for the first a_i positions of
    its i-th block and a wrong token after them, a_i cycling through 0..block_size - 1: the verify then accepts
    exactly a_i tokens and rolls the target back past every other one. It reads each block position from the hidden
    state `positions_in_hidden` leaves in it."""

    def __init__(self, expected: torch.Tensor, block_size: int, vocab: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # spec_generate casts to the head's dtype
        self.expected, self.block_size, self.vocab, self.blocks = expected, block_size, vocab, 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        right = self.blocks % self.block_size
        self.blocks += 1
        tokens = self.expected[hidden[0, :, 0].long()]
        tokens[right:] = (tokens[right:] + 1) % self.vocab
        return torch.nn.functional.one_hot(tokens, self.vocab).float()[None]


def positions_in_hidden(position_ids, noise_embedding, **kwargs) -> torch.Tensor:
    """The drafter's forward replaced: each block position's hidden state carries its position."""
    hidden = torch.zeros_like(noise_embedding)
    hidden[..., 0] = position_ids[:, -noise_embedding.shape[1] :]
    return hidden


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "jamba", "mistral"])
def test_spec_generate_rolls_the_target_back_to_every_accepted_prefix(tmp_path, arch, one_thread):
    """Blocks whose first 0, 1, ..., block_size - 1 drafts are the target's own: `crop` of the target's cache restores
    the state after each accepted prefix (recorded recurrent and conv states for the linear-attention and Mamba
    layers, the keys a sliding window dropped), so decoding stays the target's greedy output."""
    verifier, _, loaded = exported(tmp_path, arch, "full")
    prompt, new = torch.tensor([[3, 4, 5, 6, 3, 4]]), 40
    expected = verifier.generate(prompt, max_new_tokens=new + loaded.block_size, do_sample=False)
    head = AcceptSchedule(expected[0], loaded.block_size, VOCAB)
    verifier.get_output_embeddings = lambda: head  # spec_generate drafts through the target's head
    loaded.forward = positions_in_hidden
    out = loaded.spec_generate(target=verifier, input_ids=prompt, max_new_tokens=new, temperature=0.0)
    assert out.tolist() == expected[:, : prompt.shape[1] + new].tolist()
    assert head.blocks >= loaded.block_size  # every accepted length came up


def test_hybrid_reads_its_export_as_the_folder_it_came_from(tmp_path):
    verifier, drafter, _ = exported(tmp_path, "llama", "sliding")
    again = DFlashDrafter.from_pretrained(tmp_path / "export", verifier, dtype=torch.float32)
    assert again.model.kinds == drafter.model.kinds and again.fingerprint == drafter.fingerprint
    assert (tmp_path / "export" / "dflash.py").read_bytes() == Path(dflash_model.__file__).read_bytes()


def test_the_model_code_imports_only_torch_transformers_and_the_standard_library():
    """The file runs from a folder copied anywhere, where hybrid's packages are not installed."""
    tree = ast.parse(Path(dflash_model.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    outside = {
        name for name in imported if name.split(".")[0] not in {"torch", "transformers", *sys.stdlib_module_names}
    }
    assert not outside, f"drafters/dflash_model.py imports {sorted(outside)}: the exported folder could not load it"


@pytest.mark.parametrize(
    ("is_causal", "causal", "expected"), [(False, True, False), (True, False, True), (None, True, True)]
)
def test_is_causal_decides_before_dflash_config_causal_as_vllm_reads_them(tmp_path, is_causal, causal, expected):
    """vLLM (`qwen3_dflash.py`, `_dflash_layer_causal`) reads `is_causal` first, then `dflash_config.causal`."""
    verifier = tiny_model("qwen3", VOCAB, 2, seed=1)
    folder = write_dflash_folder(tmp_path / "f", verifier, is_causal=is_causal)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["causal"] = causal
    (folder / "config.json").write_text(json.dumps(config))
    assert layer_kind(read_config(folder), 0)[0] is expected
