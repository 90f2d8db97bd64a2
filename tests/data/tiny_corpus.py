"""Tiny deterministic corpora for the data tests (a module, not conftest, so tests can import it)."""

import numpy as np

_WORDS = (
    "the model reads tokens and predicts the next one while memory runs out before compute "
    "so activations move to host memory and come back for the backward pass in time"
).split()
_CODE = "def step(state, batch):\n    loss = state.apply(batch)\n    return loss * 2  # scale\n"


def make_documents(count: int, words_per_document: int = 120, seed: int = 0) -> list[str]:
    """Deterministic prose-and-code documents, distinct from each other."""
    rng = np.random.default_rng(seed)
    documents = []
    for index in range(count):
        lines = []
        for _ in range(words_per_document // 12):
            lines.append(" ".join(rng.choice(_WORDS, 12)) + f" {index}.")
        documents.append("\n".join(lines) + "\n\n" + _CODE)
    return documents
