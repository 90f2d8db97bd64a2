"""The corpus a run trained on, recorded in `RUN_DIR/corpus.json` and checked when the run resumes.

A resumed run continues from a saved data position with the tokenizer it
trained with (`RUN_DIR/tokenizer.*`, never retrained). Both mean something
only for the corpus the run started on: a local corpus edited since then
would be packed into other rows (the saved position then points elsewhere),
and tokenizing an edited corpus quietly with the old tokenizer, or training a
new tokenizer on it, would continue another run from these weights. So:

* a run that starts records each source's files (path, size, modification
  time: what the data cache keys on too, cheap for any corpus size) in
  `corpus.json`; a Hub dataset is recorded by its name (a Hub dataset is
  taken not to change under one name);
* a resumed run compares the corpus as it is now with that record; any
  difference is a `CorpusChangedError` naming the files added, removed or
  changed, or the same files read in another order (a folder linked or
  renamed: every document moves). The documented way to continue anyway,
  on the corpus as it is now (with the run's own tokenizer; the data
  position continues only if the corpus still packs into as many rows), is
  to delete `corpus.json`: the resumed run announces that it records the
  corpus anew;
* a chat/instruct run's `data.chat_template` file is recorded by the digest
  of its template text: the rows are rendered with it, so an edit is a
  changed corpus too;
* a run from before this record existed (no `corpus.json`) resumes as before,
  with a line saying that its corpus could not be checked and is recorded now.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from spillway.data import parse_hub_spec, parse_local_spec, parse_mixture
from spillway.data.chat_template_files import TOOL_USE
from spillway.recipes.config import Recipe
from spillway.recipes.train import distributed
from spillway.recipes.train.errors import RunError

CORPUS_RECORD_FILENAME = "corpus.json"
_FORMAT = 1
_NAMED = 3   # files named per kind of change in a message


class CorpusChangedError(RunError):
    """A resumed run's corpus differs from the one it started on."""


def _sources(recipe: Recipe) -> dict[str, str]:
    """{name: source spec}: "corpus" for data.source, the mixture's names otherwise."""
    if recipe.data.mixture:
        return {component.name: component.source for component in parse_mixture(recipe.data.mixture)}
    return {"corpus": recipe.data.source}


def describe_corpus(recipe: Recipe) -> dict:
    """What identifies the run's corpus now: per source, its spec and (local) files with size and mtime."""
    sources = {}
    for name, spec in _sources(recipe).items():
        if parse_hub_spec(spec) is not None:
            sources[name] = {"source": spec, "hub": True}
            continue
        files = {}
        for path in parse_local_spec(spec, recipe.data.split).files:
            stat = path.stat()
            files[str(path.resolve())] = [stat.st_size, stat.st_mtime_ns]
        sources[name] = {"source": spec, "files": files}
    record = {"format": _FORMAT, "text_field": recipe.data.text_field, "split": recipe.data.split, "sources": sources}
    template = _template_file(recipe)
    if template is not None:
        record["chat_template"] = template
    return record


def _template_file(recipe: Recipe) -> dict | None:
    """A chat/instruct run's `data.chat_template` file, by name and a digest of the template text it holds (None
    where it cannot be read): the rows are rendered with it, so an edit changes the corpus the run reads. A
    built-in is recorded by its name; the tokenizer's own template (the run resumes with its own tokenizer copy,
    which holds it) not at all."""
    from spillway.data.chat_template import BUILTIN_TEMPLATES, ChatTemplateError, resolve_chat_template

    named = recipe.data.chat_template
    if recipe.data.format == "text" or not named:
        return None
    if named in BUILTIN_TEMPLATES:   # by name: a built-in's text is the code's, not the user's
        return {"name": named}
    try:
        template = resolve_chat_template(named, None)
    except (ChatTemplateError, OSError, ValueError):
        return {"name": named, "sha256": None}
    record = {"name": named, "sha256": hashlib.sha256(template.source.encode()).hexdigest()}
    if template.named:   # a file's named templates beside its default (a tokenizer_config.json's list) render too
        record["named_sha256"] = hashlib.sha256(json.dumps(template.named, sort_keys=True).encode()).hexdigest()
        record["named"] = sorted(template.named)
    return record


def _names(paths: list[str]) -> str:
    shown = ", ".join(paths[:_NAMED])
    return shown + (f" and {len(paths) - _NAMED} more" if len(paths) > _NAMED else "")


# A run whose data.chat_template file holds a tool_use template, started before spillway rendered records with
# tools with it: its rows would now render otherwise (data/chat_template.py), mid-run.
_TOOL_USE_SINCE = ("data.chat_template {name!r} holds a tool_use template, which this run (started before spillway "
                   "rendered records with tools with it) did not use: its rows would change")


def corpus_differences(saved: dict, now: dict) -> list[str]:
    """Each difference between two `describe_corpus` records, as a phrase ([] when they agree)."""
    phrases = []
    if saved.get("text_field") != now.get("text_field"):
        phrases.append(f"data.text_field was {saved.get('text_field')!r}, now {now.get('text_field')!r}")
    if saved.get("split", "train") != now.get("split", "train"):   # a record from before data.split: train
        phrases.append(f"data.split was {saved.get('split', 'train')!r}, now {now.get('split', 'train')!r}")
    before, after = saved.get("chat_template"), now.get("chat_template")
    if before is not None and after is not None and "named_sha256" not in before:   # recorded before they were
        if TOOL_USE in after.get("named", ()) and before.get("sha256") == after.get("sha256"):
            phrases.append(_TOOL_USE_SINCE.format(name=before.get("name")))
        after = {key: value for key, value in after.items() if key not in ("named_sha256", "named")}
    if before is not None and before != after:   # a record from before templates were recorded: not compared
        if after is None or before.get("name") != after.get("name"):
            now_named = repr(after.get("name")) if after else "the tokenizer's own template"
            phrases.append(f"data.chat_template was {before.get('name')!r}, now {now_named}")
        elif after.get("sha256") is None:
            phrases.append(f"data.chat_template {before.get('name')!r} is gone or unreadable (the template the run "
                           f"trained with is kept in its tokenizer_config.json: point data.chat_template there)")
        elif before.get("sha256") == after.get("sha256"):
            phrases.append(f"data.chat_template {before.get('name')!r}: its named templates (beside the default) "
                           f"were edited")
        else:
            phrases.append(f"data.chat_template {before.get('name')!r}: its template text was edited")
    saved_sources, now_sources = saved.get("sources", {}), now.get("sources", {})
    for name in sorted(set(saved_sources) | set(now_sources)):
        before, after = saved_sources.get(name), now_sources.get(name)
        label = "" if set(now_sources) == {"corpus"} else f"source {name!r}: "
        if _moved_whole(before, after):   # the same files at another place (the project folder moved)
            continue
        if before is None or after is None or before.get("source") != after.get("source"):
            phrases.append(f"{label}was {before and before.get('source')!r}, now {after and after.get('source')!r}")
            continue
        old_files, new_files = before.get("files") or {}, after.get("files") or {}
        added = sorted(set(new_files) - set(old_files))
        removed = sorted(set(old_files) - set(new_files))
        changed = sorted(path for path in set(old_files) & set(new_files) if old_files[path] != new_files[path])
        for paths, what in ((changed, "changed (size or modification time)"), (removed, "removed"),
                            (added, "added")):
            if paths:
                phrases.append(f"{label}{len(paths)} file{'s' if len(paths) > 1 else ''} {what}: {_names(paths)}")
        if not (added or removed) and list(old_files) != list(new_files):
            # the same files in another order (the record keeps the order read): every document moves, the
            # saved position points at other rows
            first = next(path for path, was in zip(new_files, old_files) if path != was)
            phrases.append(f"{label}the same files are read in another order now (first moved: {first})")
    return phrases


def _below_their_root(files: dict) -> list:
    """A source's recorded files as [(path below their common folder, [size, mtime])], in the order read."""
    if not files:
        return []
    root = os.path.commonpath(list(files)) if len(files) > 1 else os.path.dirname(next(iter(files)))
    return [(os.path.relpath(path, root), stat) for path, stat in files.items()]


def _moved_whole(before: dict | None, after: dict | None) -> bool:
    """Whether two records of a local source are the same files in the same order, each of the same size and
    modification time, below another folder: a project moved with its data (`mv` keeps the times; a copy that
    does not is a changed corpus, as for any file)."""
    if not (before and after and before.get("files") and after.get("files")):
        return False
    return _below_their_root(before["files"]) == _below_their_root(after["files"])


def corpus_moved_with_the_run(recipe: Recipe) -> bool:
    """Whether the corpus the run recorded when it started is, file for file, the one `recipe` names now below
    another folder (data.source named at the project's new place): what lets data.source and data.mixture
    differ on a resume (recipes/train/resume.py). False where the record is missing or unreadable."""
    try:
        saved = json.loads((Path(recipe.run_dir) / CORPUS_RECORD_FILENAME).read_text())
        now = describe_corpus(recipe)
    except (OSError, ValueError):
        return False
    saved_sources, now_sources = saved.get("sources", {}), now.get("sources", {})
    return (set(saved_sources) == set(now_sources) and not corpus_differences(saved, now)
            and all(_moved_whole(saved_sources[name], now_sources[name]) for name in now_sources))


def record_corpus(run_dir: str | os.PathLike, recipe: Recipe) -> Path:
    """Writes `RUN_DIR/corpus.json` for the corpus as it is now (atomically; process 0 only)."""
    path = Path(run_dir) / CORPUS_RECORD_FILENAME
    if distributed.is_main_process():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(describe_corpus(recipe), indent=1) + "\n")
        tmp.replace(path)
    return path


def check_corpus(run_dir: str | os.PathLike, recipe: Recipe, *, resuming: bool, say=print) -> bool:
    """Records the corpus of a run that starts; holds a resumed run's corpus against its record.

    Raises CorpusChangedError naming what changed. A resumed run without a record (written before it
    existed, or deleted on purpose) returns True: the caller records the corpus anew (`record_corpus`) once
    the resume has read its data position from the step; a resume refused before that (the corpus packs into
    other rows) leaves no record of a corpus the run never trained on, so restoring the files resumes.
    """
    path = Path(run_dir) / CORPUS_RECORD_FILENAME
    if resuming and not path.is_file():
        say(f"corpus: {path} is absent (a run from before corpus records, or deleted to accept the corpus "
            f"as it is now): the corpus cannot be checked against the one this run trained on; recording "
            f"it as it is now once the run resumes, with the run's own tokenizer")
        return True
    if not resuming:
        record_corpus(run_dir, recipe)
        return False
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorpusChangedError(f"{path}: unreadable ({e}); delete it to resume on the corpus as it is "
                                 f"now") from e
    now = describe_corpus(recipe)
    differences = corpus_differences(saved, now)
    if not differences and now != saved:   # the same files at another place: the record follows them
        record_corpus(run_dir, recipe)
    if differences:
        raise CorpusChangedError(
            f"{run_dir}: cannot resume: the corpus changed since this run started ({'; '.join(differences)}). "
            f"A resumed run reads the corpus it trained on, with the tokenizer it trained: restore those files, "
            f"or train into another checkpoint.dir (fine-tune with checkpoint.init_from); to continue on the "
            f"corpus as it is now with this run's tokenizer, delete {path}")
    return False
