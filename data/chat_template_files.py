"""Where a tokenizer folder keeps its chat templates, read and written as transformers reads and writes them.

A folder's templates are named: "default", and others such as "tool_use" (the one transformers'
`apply_chat_template(tools=...)` renders with when there is one). transformers 5 saves them as files,
`chat_template.jinja` (the default) and `additional_chat_templates/<name>.jinja`; older checkpoints keep them
in tokenizer_config.json's "chat_template", a string (the default) or a list of {"name", "template"}. Files,
where any exist, replace the config's entry whole (transformers' `from_pretrained` reads them first and only).
"""

from __future__ import annotations

import json
from pathlib import Path

from spillway.layers.errors import DataError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"   # transformers >= 4.43 may save the template beside the config
CHAT_TEMPLATE_DIR = "additional_chat_templates"   # transformers 5: each named template other than the default
DEFAULT = "default"
TOOL_USE = "tool_use"   # transformers renders a conversation given tools with it, where a folder has one


class ChatTemplateError(DataError):
    """A chat template that cannot be found, compiled or rendered: one line naming it and why."""


def read_config(path: Path) -> dict:
    """A tokenizer_config.json as a dict (one that is not an object reads as empty); ChatTemplateError when it
    is not JSON."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ChatTemplateError(f"{path} is not readable JSON: {error}; fix it, or copy it again from where "
                                f"the tokenizer came from (the checkpoint or run it belongs to)") from None
    return data if isinstance(data, dict) else {}


def templates_in_config(config: dict) -> dict[str, str]:
    """The named templates of a tokenizer_config.json's "chat_template": a string is the default; a list of
    {"name", "template"} (or a name -> template object) names each. Empty where it holds none."""
    entry = config.get("chat_template")
    if isinstance(entry, str):
        named = {DEFAULT: entry}
    elif isinstance(entry, list):
        named = {item.get("name"): item.get("template") for item in entry if isinstance(item, dict)}
    elif isinstance(entry, dict):
        named = entry
    else:
        named = {}
    named = {name: text for name, text in named.items() if isinstance(name, str) and isinstance(text, str) and text}
    for name in named:
        _check_name(name)
    return named


def _check_name(name: str) -> None:
    """A template's name is a file name (additional_chat_templates/<name>.jinja): nothing that leaves the folder."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ChatTemplateError(f"chat template name {name!r} is not a plain file name (transformers saves each "
                                f"named template as {CHAT_TEMPLATE_DIR}/<name>.jinja): rename it")


def named_template_files(directory: Path) -> list[Path]:
    """The named templates' files in `directory` (additional_chat_templates/*.jinja), sorted."""
    extra = directory / CHAT_TEMPLATE_DIR
    return sorted(path for path in extra.glob("*.jinja") if path.is_file()) if extra.is_dir() else []


def template_files(directory: Path) -> dict[str, Path]:
    """The template files in `directory`, by name: chat_template.jinja is the default (a named default.jinja
    wins over it, as in transformers' reading)."""
    files = {DEFAULT: directory / CHAT_TEMPLATE_FILE} if (directory / CHAT_TEMPLATE_FILE).is_file() else {}
    files.update({path.name.removesuffix(".jinja"): path for path in named_template_files(directory)})
    return files


def tokenizer_templates(directory: Path) -> tuple[dict[str, str], Path] | None:
    """(the folder's named templates, the file or folder holding them), in the order transformers reads them:
    the .jinja files, else tokenizer_config.json's entry; None when it has none."""
    files = template_files(directory)
    if files:
        where = files[DEFAULT] if DEFAULT in files else directory / CHAT_TEMPLATE_DIR
        return {name: path.read_text(encoding="utf-8") for name, path in files.items()}, where
    config_path = directory / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        named = templates_in_config(read_config(config_path))
        if named:
            return named, config_path
    return None


def tokenizer_template(directory: Path) -> str | None:
    """The folder's default chat template; None when it has none, or names no default."""
    found = tokenizer_templates(directory)
    return found[0].get(DEFAULT) if found is not None else None


def config_entry(named: dict[str, str]):
    """tokenizer_config.json's "chat_template" for these templates: the default alone as a string, several as
    the list transformers reads."""
    if set(named) == {DEFAULT}:
        return named[DEFAULT]
    return [{"name": name, "template": text} for name, text in named.items()]


def write_templates(directory: Path, named: dict[str, str], special_tokens: dict[str, str] | None = None) -> None:
    """The templates into the tokenizer folder `directory` so that both readers find them: its
    tokenizer_config.json's entry (and `special_tokens`), and, where the folder keeps its templates as files
    (a checkpoint saved by transformers 5 whose files were copied with it), those files too, which
    transformers reads instead of the entry."""
    from spillway.data.cache import atomic_write_bytes

    path = directory / TOKENIZER_CONFIG_FILE
    config = read_config(path) if path.is_file() else {}
    config.update({"chat_template": config_entry(named), **(special_tokens or {})})
    atomic_write_bytes(path, (json.dumps(config, indent=2) + "\n").encode())
    kept = template_files(directory)
    if not kept:
        return
    for name, text in named.items():
        if name == DEFAULT:   # (an additional_chat_templates/default.jinja, which would win over it, goes below)
            atomic_write_bytes(directory / CHAT_TEMPLATE_FILE, text.encode())
        else:
            (directory / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
            atomic_write_bytes(directory / CHAT_TEMPLATE_DIR / f"{name}.jinja", text.encode())
    for name, path in kept.items():
        # a copied folder's template the run does not render with, which transformers would read beside (or, a
        # default among the named files, instead of) the run's own
        if name not in named or (name == DEFAULT and path != directory / CHAT_TEMPLATE_FILE):
            path.unlink()
