"""Long-document selection and up-sampling for the long-context stages (GLM-5: 32K, 128K, 200K).

GLM-5 mid-trains at 32K (1T tokens), 128K (500B) and 200K (50B) with long documents up-sampled
(GLM-5 report). Packing alone does not give long-range dependencies: a 128K window
filled with 2K-token documents teaches nothing beyond 2K. Two knobs do:

* `data.seq_length` is the stage's context length (one config per stage).
* `data.min_document_length` is a list aligned with the blend entries of `data.data_path`: entry i
  draws only from documents of at least that many tokens (EOD included; 0 = all documents).
  The blend weights then set how often each entry is sampled, so listing a corpus twice, once
  unfiltered and once filtered, up-samples its long documents:

      data:
        seq_length: 32768
        data_path: ["0.6", "web", "0.4", "web"]
        min_document_length: [0, 32768]     # 40% of the windows come from documents >= 32K tokens

The filter restricts a `GPTDataset`'s document indices after the train/valid/test split, so the
splits stay disjoint and the filtered entry sees a subset of the same split. Which filter an entry
carries travels inside its dataset path (`PREFIX[min_document_length=N]`): megatron's builder
hands each mid-level dataset only its path, and the path is part of megatron's cache key, so a
filtered and an unfiltered view of one prefix never share cached indices.
"""

from __future__ import annotations

import re
from typing import List, Sequence, Tuple

import numpy

_FILTER = re.compile(r"^(?P<prefix>.*)\[min_document_length=(?P<n>\d+)\]$")


def with_min_document_length(prefix: str, min_length: int) -> str:
    """The dataset path megatron sees for `prefix` restricted to documents >= min_length tokens."""
    return prefix if min_length <= 0 else f"{prefix}[min_document_length={min_length}]"


def split_min_document_length(dataset_path: str) -> Tuple[str, int]:
    """Inverse of `with_min_document_length`: (prefix, min_length), min_length 0 when unfiltered."""
    match = _FILTER.match(dataset_path)
    if match is None:
        return dataset_path, 0
    return match.group("prefix"), int(match.group("n"))


def min_lengths_for(prefixes: Sequence[str], min_document_length: Sequence[int]) -> List[int]:
    """`data.min_document_length` checked against the blend: one entry per prefix, or empty for none."""
    if not min_document_length:
        return [0] * len(prefixes)
    if len(min_document_length) != len(prefixes):
        raise ValueError(
            f"data.min_document_length has {len(min_document_length)} entries but data.data_path has "
            f"{len(prefixes)} blend entries ({list(prefixes)}); give one length per entry (0 = no filter) or []"
        )
    if any(n < 0 for n in min_document_length):
        raise ValueError(
            f"data.min_document_length {list(min_document_length)} has a negative entry; use 0 for no filter"
        )
    return list(min_document_length)


def select_long_documents(indices: numpy.ndarray, sequence_lengths: numpy.ndarray, min_length: int) -> numpy.ndarray:
    """The document ids in `indices` whose length is at least `min_length` tokens, order kept."""
    if min_length <= 0:
        return indices
    return indices[sequence_lengths[indices] >= min_length].astype(numpy.int32)
