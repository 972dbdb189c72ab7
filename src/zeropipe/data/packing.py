"""Packing several examples into each sequence of ``max_seq_len`` tokens.

Instruction data has a wide spread of lengths: padded to the longest example of a batch,
most of a batch can be padding. Packing concatenates examples into sequences that are
nearly full, and keeps them apart with position ids that restart at 0 for every example
(the convention of transformers' ``DataCollatorWithFlattening``). With no attention mask and
no KV cache, transformers reads the example boundaries from those position ids
(``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal mask for
sdpa and eager attention, so no token attends to another example. Every example's first
label is ``IGNORE_INDEX`` (the token cache already guarantees it, the collator enforces it),
so the last token of one example never predicts the first token of the next: the loss of
a packed batch is the loss of the same examples padded.

Which examples share a sequence is decided once, in the launcher, from the example lengths
(best-fit decreasing, deterministic) and written beside the token cache, so every rank and
every resume agrees; the sampler then shuffles the packed sequences each epoch.
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from zeropipe.data.token_cache import TokenDataset, pad_right
from zeropipe.data.tokenize import IGNORE_INDEX
from zeropipe.errors import DataError

PACK_FILES = ("pack_members.npy", "pack_offsets.npy", "packs.json")


def pack_lengths(lengths: np.ndarray | list[int], capacity: int) -> list[list[int]]:
    """Group example indices into packs of at most ``capacity`` tokens (best-fit decreasing).

    Examples are placed longest first, each into the fullest pack it still fits in (a new
    pack when none has room). The result depends only on the lengths: ties are broken by
    example index. Packs come out in order of creation; members in order of placement.

    Raises:
        DataError: an example longer than ``capacity`` (the cache truncates at max_seq_len,
            so this means the cache and the config disagree).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > capacity:
        raise DataError(
            f"an example of {int(lengths.max())} tokens does not fit in a packed sequence of {capacity}: "
            "the token cache was built with a longer data.max_seq_len; start a new run to rebuild it"
        )
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, then by index
    packs: list[list[int]] = []
    # (room left, pack index), sorted: the first entry with room >= length is the best fit.
    rooms: list[tuple[int, int]] = []
    for index in order.tolist():
        length = int(lengths[index])
        position = bisect.bisect_left(rooms, (length, -1))
        if position < len(rooms):
            room, pack = rooms.pop(position)
        else:
            room, pack = capacity, len(packs)
            packs.append([])
        packs[pack].append(index)
        if room - length > 0:
            bisect.insort(rooms, (room - length, pack))
    return packs


def build_pack_index(cache_dir: Path, max_seq_len: int) -> dict[str, Any]:
    """Decide the packs of a token cache and write them into the cache directory; run by the launcher."""
    cache_dir = Path(cache_dir)
    lengths = TokenDataset(cache_dir).lengths()
    packs = pack_lengths(lengths, max_seq_len)
    members = np.fromiter((index for pack in packs for index in pack), dtype=np.int64, count=len(lengths))
    offsets = np.concatenate([[0], np.cumsum([len(pack) for pack in packs])]).astype(np.int64)
    tokens = int(lengths.sum())
    info = {
        "max_seq_len": max_seq_len,
        "examples": len(lengths),
        "packs": len(packs),
        "tokens": tokens,
        # Share of the packed sequences' max_seq_len slots that hold a real token.
        "fill": tokens / max(1, len(packs) * max_seq_len),
    }
    (cache_dir / "packs.json").unlink(missing_ok=True)  # written last: its presence means complete
    for name, array in (("pack_members.npy", members), ("pack_offsets.npy", offsets)):
        temporary = cache_dir / f"{name}.partial"
        with open(temporary, "wb") as handle:
            np.save(handle, array)
        os.replace(temporary, cache_dir / name)
    (cache_dir / "packs.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def read_pack_info(cache_dir: Path) -> dict[str, Any] | None:
    """The pack index's summary, or None when the cache has no complete pack index."""
    path = Path(cache_dir) / "packs.json"
    return json.loads(path.read_text()) if path.is_file() else None


class PackedDataset(Dataset):
    """The packed sequences of a token cache: item ``i`` is pack ``i``'s examples end to end."""

    def __init__(self, cache_dir: Path):
        self.cache_dir = Path(cache_dir)
        if read_pack_info(self.cache_dir) is None:
            raise DataError(
                f"{self.cache_dir} has no pack index (packs.json): it is built by the launcher when data.packing is on; "
                "start the run again with `zeropipe train` to build it"
            )
        self.examples = TokenDataset(self.cache_dir)
        self._members = np.load(self.cache_dir / "pack_members.npy", mmap_mode="r")
        self._offsets = np.load(self.cache_dir / "pack_offsets.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def members(self, index: int) -> list[int]:
        """The example indices packed into sequence ``index``."""
        return [int(i) for i in self._members[int(self._offsets[index]) : int(self._offsets[index + 1])]]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"packed sequence {index} out of range for {len(self)}")
        return pack_examples([self.examples[i] for i in self.members(index)])


def pack_examples(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Examples end to end in one sequence, positions restarting at 0 for each."""
    labels = []
    for example in examples:
        example_labels = example["labels"].clone()
        # The first token has nothing before it in its example: never a target, so the
        # previous example's last token never learns to predict it.
        example_labels[0] = IGNORE_INDEX
        labels.append(example_labels)
    return {
        "input_ids": torch.cat([example["input_ids"] for example in examples]),
        "labels": torch.cat(labels),
        "position_ids": torch.cat([torch.arange(len(example["input_ids"])) for example in examples]),
    }


def collate_packed(batch: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Packed sequences padded on the right to the longest; no attention mask (transformers reads
    the example boundaries from ``position_ids``, and only does so when the mask is absent).

    Padding gets positions 0, 1, 2... of its own, so transformers treats it as one more
    example that nothing else attends to; its labels carry no loss. ``num_tokens`` and
    ``num_examples`` count the real (non-padding) tokens and the examples, which the trainer
    reports as tokens/s and samples/s and removes before the forward pass.
    """
    input_ids, labels, lengths = pad_right(batch, pad_token_id)
    longest = input_ids.shape[1]
    position_ids = torch.zeros_like(input_ids)
    for row, (sequence, length) in enumerate(zip(batch, lengths)):
        position_ids[row, :length] = sequence["position_ids"]
        position_ids[row, length:] = torch.arange(longest - length)
    real_tokens = sum(lengths)
    examples = int((position_ids == 0).sum()) - sum(1 for length in lengths if length < longest)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "num_tokens": torch.tensor(real_tokens),
        "num_examples": torch.tensor(examples),
    }
