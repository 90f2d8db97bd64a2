"""Fine-tuning settings checked before the run directory is taken or any data prepared.

* `data.format=chat`/`instruct` on a corpus of text files (no records to read conversations from);
* `data.document_mask` with an attention implementation that cannot keep packed examples apart
  (layers/segment_mask.py: cuDNN).

The records themselves (missing fields, unknown roles, a template that fails to render) are checked as they
are tokenized (data/sft_packing.py), which also comes before the first step: each is one DataError line.
"""

from __future__ import annotations

from spillway.data.mixture import parse_mixture
from spillway.data.sft_formats import check_not_text_corpus
from spillway.layers.segment_mask import check_segment_support
from spillway.recipes.config import Recipe


def check_fine_tuning_inputs(recipe: Recipe) -> None:
    """DataError / ConfigError for the settings above; nothing for a plain text run."""
    data = recipe.data
    if data.format != "text":
        sources = [c.source for c in parse_mixture(data.mixture)] if data.mixture else [data.source]
        for source in sources:
            check_not_text_corpus(source, data.format, data.split)
    if data.uses_document_mask:
        check_segment_support(recipe.execution.attention_impl)
