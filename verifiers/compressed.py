"""DeepSeek-V4's compressed attention, kept in slots so that a rollback is a length, as for keys and values.

Beside its sliding window, a V4 layer attends to compressed entries: every `compress_rate` tokens (4 for compressed
sparse attention, 128 for heavily compressed attention) its compressor pools the tokens' projections into one entry.
transformers' cache holds the projections of the tokens since the last closed window (a buffer), the entries, their
count, and (for compressed sparse attention, whose entry w also pools window w - 1) the previous window's half. A
verify of drafts would close windows of tokens that may be rejected, and none of that can be cropped.

Here every token's projections stay in the slot of its position, every entry in the slot of its window, and every
closed window's half beside it. What transformers' cache holds after n tokens is then read off the slots: the buffer
is the tokens from the last window boundary at or before n, the entries those of the windows before it, the previous
half that of the window before that boundary. A forward hands the model exactly that, as its cache would after the
row's committed tokens; the windows it closes are written over whatever a rejected draft left. Nothing is copied on
rollback, and an entry is formed only from the tokens the row holds when it is formed.

transformers counts the closed windows once for all rows of a forward, so rows of one length share a forward
(`support.row_mask_problem` names this).
"""

from __future__ import annotations

import torch


class CompressedEntries:
    """One V4 layer's compressor state in slots, for its compressor ("compressor") and, in compressed sparse
    attention, its indexer's own ("indexer"). Mixed into the cache's layer, whose `owner` is the `SharedCache`."""

    def __init__(self, compress_rate: int):
        self.compress_rate = compress_rate
        self.projections: dict[str, list[torch.Tensor]] = {}  # name -> [kv, gate], each [rows, capacity, width]
        self.entries: dict[str, torch.Tensor] = {}  # name -> [rows, windows, width], window w's entry in slot w
        self.halves: dict[str, list[torch.Tensor]] = {}  # name -> [kv, gate] [rows, windows, rate, width]: Ca halves
        self.first_window: dict[str, int] = {}  # name -> the first window the forward in flight may close

    @property
    def windows(self) -> int:
        """Window slots: one per compress_rate slots, and one for a window closed by the tokens past them."""
        return self.owner.capacity // self.compress_rate + 1

    def _start(self) -> int:
        starts = set(self.owner._forward_start)
        if len(starts) != 1:
            raise RuntimeError(
                f"a compressed-attention forward over rows of lengths {sorted(starts)}: rows of one length"
            )
        return starts.pop()

    def _buffer(self, shape, like: torch.Tensor) -> torch.Tensor:
        return self.owner.allocate(shape, like.dtype, like.device)

    def store_compression_weights(
        self, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Keep the fed tokens' projections; return those of the windows this forward closes (from the row's last
        boundary on, as transformers' buffer holds them) and the position of the first."""
        if name not in self.projections:
            rows = kv.shape[0]
            self.projections[name] = [self._buffer((rows, self.owner.capacity, t.shape[-1]), t) for t in (kv, gate)]
        kept_kv, kept_gate = self.projections[name]
        self.owner.write(kept_kv, kv, dim=1)
        self.owner.write(kept_gate, gate, dim=1)
        start, rate = self._start(), self.compress_rate
        first, end = start // rate * rate, (start + kv.shape[1]) // rate * rate
        self.first_window[name] = first // rate
        return kept_kv[:, first:end], kept_gate[:, first:end], first

    def update_overlap_state(
        self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Keep the closed windows' first halves (gate with its position bias, as the model passes it); return the
        half of the window before them, or None where they are the row's first."""
        rows, closed, rate = chunk_kv.shape[:3]
        if name not in self.halves:
            self.halves[name] = [self._buffer((rows, self.windows, rate, head_dim), t) for t in (chunk_kv, chunk_gate)]
        first = self.first_window[name]
        for kept, new in zip(self.halves[name], (chunk_kv, chunk_gate)):
            kept[:, first : first + closed] = new[..., :head_dim]
        if first == 0:
            return None, None
        kv, gate = self.halves[name]
        return kv[:, first - 1], gate[:, first - 1]

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """Keep the entries of the windows this forward closed; return every entry of the row's closed windows."""
        if name not in self.entries:
            rows, _, width = compressed.shape
            self.entries[name] = self._buffer((rows, self.windows, width), compressed)
        first = self.first_window[name]
        entries = self.entries[name]
        entries[:, first : first + compressed.shape[1]] = compressed
        return entries[:, : first + compressed.shape[1]]

    def resize_compressed(self) -> None:
        """After the owner's capacity grew: every buffer widened, contents kept."""
        for name, pair in self.projections.items():
            self.projections[name] = [self.owner.grow(t, 1) for t in pair]
        for name, entries in self.entries.items():
            self.entries[name] = self.owner.grow(entries, 1, self.windows)
        for name, pair in self.halves.items():
            self.halves[name] = [self.owner.grow(t, 1, self.windows) for t in pair]

    def select_compressed(self, index: torch.Tensor) -> None:
        for store in (self.projections, self.halves):
            for name, pair in store.items():
                store[name] = [t[index.to(t.device)] for t in pair]
        self.entries = {name: t[index.to(t.device)] for name, t in self.entries.items()}

    def export_compressed(self, layer, row: int, length: int) -> None:
        """Fill transformers' V4 cache layer `layer` with row `row`'s state after its first `length` tokens."""
        closed = length // self.compress_rate
        for name, (kv, gate) in self.projections.items():
            start = closed * self.compress_rate
            layer.buffer_kv[name] = kv[row : row + 1, start:length].clone()
            layer.buffer_gate[name] = gate[row : row + 1, start:length].clone()
            layer.entry_count[name] = closed
        for name, entries in self.entries.items():
            layer.compressed_kv[name] = entries[row : row + 1, :closed].clone()
        for name, (kv, gate) in self.halves.items():
            if closed:
                layer.overlap_kv[name] = kv[row : row + 1, closed - 1].clone()
                layer.overlap_gate[name] = gate[row : row + 1, closed - 1].clone()
