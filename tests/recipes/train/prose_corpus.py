"""A second, offline corpus for mixture tests: deterministic prose documents, unlike the stdlib's code.

Every document holds the made-up word "zyxquorble", which the stdlib corpus never does, so a tokenizer
that saw this corpus encodes it in few pieces and one that did not in many.
"""

from pathlib import Path

import numpy as np

MARKER = "zyxquorble"
_WORDS = ("river stone light garden morning quiet letter window bread music travel winter " + MARKER).split()


def write_prose(folder: Path, documents: int = 120, lines: int = 30) -> Path:
    """`documents` .txt files of `lines` ten-word sentences each, in `folder` (created); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index in range(documents):
        sentences = (" ".join(rng.choice(_WORDS, 10)) + "." for _ in range(lines))
        (folder / f"doc{index:03d}.txt").write_text("\n".join(sentences) + "\n")
    return folder
