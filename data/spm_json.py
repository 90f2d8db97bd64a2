"""A sentencepiece model as a Hugging Face `tokenizer.json` that encodes exactly as sentencepiece does.

`spillway export` writes one beside a run's `tokenizer.model` (recipes/export.py), so that transformers'
AutoTokenizer and the `tokenizers` library read the ids the run trained on. Left to transformers, the
`.model` is rebuilt by the class the model family names: GPT-2's and Qwen's byte-level classes misread it
whole, Gemma's rebuilds a unigram model as BPE and drops the model's normalizer. Here the model's own
settings are followed, as transformers' `SpmConverter.build_tokenizer_from_spm_proto` does:

- normalizer, in sentencepiece's order: the model's character map (`nmt_nfkc`'s NFKC and its whitespace
  folding; none for `identity`), extra spaces removed (`remove_extra_whitespaces`: leading and trailing
  ones, runs as one), spaces as "▁", the dummy prefix "▁" before a non-empty text (`add_dummy_prefix`);
- model: Unigram with the pieces' scores for a unigram model; BPE for a BPE model, whose merges are every
  split of a piece into two pieces, ranked by the whole piece's score (sentencepiece merges the adjacent pair
  whose union is the best-scored piece; it keeps no merge list); byte fallback as the model has it;
- control pieces (`<s>`, `</s>`, `<pad>`) and the unknown piece as special tokens, user-defined pieces kept
  whole (sentencepiece never merges them);
- decoder: "▁" back to spaces, byte pieces to their bytes, the dummy prefix's space dropped.

Known differences. Transformers' conventions: a special token's text inside a document (`"<s>"`) is that
token to transformers and characters to sentencepiece; decoding keeps special tokens' text, which sentencepiece
drops. Near-ties: a unigram model's paths of equal pieces in another order (a run of 33 spaces as 16+16+1 or
1+16+16) are told apart by float rounding, sentencepiece's in float32, the `tokenizers` library's in float64
(6 of 7,641 lines of Python source). With user-defined pieces, a stretch between them that is exactly a byte
piece's name ("<0x41>") is that byte to `tokenizers` (the BPE takes a stretch found in its vocabulary whole).
"""

from __future__ import annotations

import json
import re

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .spm_tokenizer import parse_model_proto

# sentencepiece's piece types (sentencepiece_model.proto ModelProto.SentencePiece.Type) and model types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
SPACE = "\u2581"
# Unigram scores of the pieces text never matches (byte, control, unused pieces, the unknown piece): sentencepiece
# leaves them out of its lattice, the `tokenizers` Unigram would match their text ("<0x41>") at score 0. Low
# enough that no path takes one (byte fallback looks them up by name), not so low that sums lose precision.
_NEVER_MATCHED = -1e6


def unsupported_reason(model_proto: bytes) -> str | None:
    """Why the model cannot be written as an exact tokenizer.json (None when it can)."""
    from google.protobuf.message import DecodeError

    try:
        proto = parse_model_proto(model_proto)
    except DecodeError as error:
        return f"it is not a sentencepiece model ({error})"
    if not proto.pieces:
        return "it holds no pieces"
    if proto.trainer_spec.model_type not in (UNIGRAM, BPE):
        return f"its model type is {proto.trainer_spec.model_type} (only unigram and BPE models are converted)"
    if proto.trainer_spec.treat_whitespace_as_suffix:
        return "it treats whitespace as a suffix, which no tokenizer.json normalizer reproduces"
    return None


def _bpe_merges(proto) -> list[tuple[str, str]]:
    """Every (left, right) whose union is a normal piece, both halves normal pieces, best-scored union first."""
    normal = {piece.piece: (piece.score, index) for index, piece in enumerate(proto.pieces) if piece.type == NORMAL}
    ranked = []
    for text, (score, index) in normal.items():
        ranked += [(-score, index, text[:cut], text[cut:]) for cut in range(1, len(text))
                   if text[:cut] in normal and text[cut:] in normal]
    return [(left, right) for _, _, left, right in sorted(ranked)]


def _model(proto, user_defined: list[str]):
    byte_fallback = proto.trainer_spec.byte_fallback
    if proto.trainer_spec.model_type == UNIGRAM:
        vocab = [(piece.piece, piece.score if piece.type in (NORMAL, USER_DEFINED) else _NEVER_MATCHED)
                 for piece in proto.pieces]
        return models.Unigram(vocab, unk_id=proto.trainer_spec.unk_id, byte_fallback=byte_fallback)
    vocab = {piece.piece: index for index, piece in enumerate(proto.pieces)}
    # a user-defined piece, cut out by the pre-tokenizer, is found whole in the vocabulary, never merged to
    return models.BPE(vocab, _bpe_merges(proto), unk_token=proto.trainer_spec.unk_piece, fuse_unk=True,
                      byte_fallback=byte_fallback, ignore_merges=bool(user_defined))


def _normalizer(spec):
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:   # spaces only: the character map has made other whitespace spaces already
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    if spec.add_dummy_prefix:   # always, as sentencepiece does (a Metaspace writes none before a "▁")
        steps.append(normalizers.Prepend(SPACE))
    return normalizers.Sequence(steps)


def tokenizer_json(model_proto: bytes, bos: tuple[str, int] | None = None) -> str:
    """The tokenizer.json text of a sentencepiece model (`unsupported_reason` says None of it). `bos`: the
    (token, id) that starts each text encoded with special tokens, where the run put one before each document
    (transformers adds none of its own to a tokenizer.json: add_bos_token does not reach it)."""
    proto = parse_model_proto(model_proto)
    spec = proto.normalizer_spec
    user_defined = [piece.piece for piece in proto.pieces if piece.type == USER_DEFINED]
    tokenizer = Tokenizer(_model(proto, user_defined))
    tokenizer.normalizer = _normalizer(spec)
    if user_defined:   # matched in the normalized text, as sentencepiece matches them, longest first
        pattern = "|".join(re.escape(text) for text in sorted(user_defined, key=len, reverse=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    steps = [decoders.Replace(SPACE, " ")] + ([decoders.ByteFallback()] if proto.trainer_spec.byte_fallback else [])
    steps.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens([AddedToken(piece.piece, special=True, normalized=False)
                                  for piece in proto.pieces if piece.type in (CONTROL, UNKNOWN)])
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos])
    return json.dumps(json.loads(tokenizer.to_str()), ensure_ascii=False, indent=2) + "\n"
