"""A DFlash folder hybrid writes is deployable: it carries its model code and `auto_map`, so z-lab's documented
`AutoModel.from_pretrained(folder, trust_remote_code=True)` loads it offline, with the weight names and shapes of
hybrid's drafter and the same forward; its `spec_generate` decodes as the target's greedy `generate`; and hybrid
reads its own exports and z-lab's folders as before. The folder's model code is the file that defines hybrid's
DFlash model, so it imports nothing of hybrid."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
from test_dflash import VARIANTS, write_dflash_folder
from transformers import AutoModel, DynamicCache

from drafters import DFlashDrafter, dflash_model
from drafters.dflash import read_config
from drafters.dflash_model import layer_kind, layer_masks
from hybrid.testing import tiny_model

VOCAB = 64


def exported(tmp_path: Path, arch: str, variant: str):
    """(verifier, hybrid's drafter, the reference-call model) for a z-lab-format folder re-saved by hybrid."""
    verifier = tiny_model(arch, VOCAB, 2, seed=1)
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


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
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


def test_spec_generate_of_the_loaded_folder_is_the_targets_greedy_output(tmp_path):
    """z-lab's documented use of the loaded drafter: `draft.spec_generate(target=..., ...)` decodes losslessly."""
    verifier, _, loaded = exported(tmp_path, "qwen3", "sliding")
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4]])
    expected = verifier.generate(prompt, max_new_tokens=20, do_sample=False)
    out = loaded.spec_generate(target=verifier, input_ids=prompt, max_new_tokens=20, temperature=0.0)
    assert out.tolist() == expected.tolist()
    stop = int(expected[0, prompt.shape[1] + 5])
    stopped = loaded.spec_generate(verifier, prompt, max_new_tokens=20, stop_token_ids=[stop])
    assert stopped[0, -1] == stop and stopped[0].tolist() == expected[0, : stopped.shape[1]].tolist()


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
