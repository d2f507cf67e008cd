"""MkDocs hook: the documentation's reference pages, generated from the code at every build so they cannot drift.

A page asks for a generated part with a marker line, replaced at build time:

- ``<!-- generated: config-reference -->``: every key of an experiment config, from its JSON Schema
  (``fedrod_ray.config.config_schema()``), described by the comment beside the field in ``fedrod_ray/config/`` or
  ``fedrod_ray/specs/`` (the schema carries no descriptions), each generic rule's ``train.rule_params`` and each
  personalization method's ``train.head_params``;
- ``<!-- generated: cli-reference -->``: every ``fedrod-ray`` subcommand from the argparse parser, the commands
  that the ``fedrod_ray.commands`` entry points register (``serve``, ``tune``, ``reproduce``) included;
- ``<!-- generated: http-api -->``: the HTTP API's operations from the OpenAPI document of an app serving a
  freshly built MNIST-shaped model (the document is model-specific); the document itself is published as
  ``http-api/openapi.json``.

It also publishes ``bench/results/**/curves.png`` at the same path in the site, and points a page's
``../bench/results/`` links there: ``docs/results.md`` (written by ``bench/fmnist_results.py``) shows the
reproduction's curves on GitHub and in the site alike. Nothing here needs the network.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import json
import os
import re
import sys
import tempfile
import tokenize
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
OPENAPI_URI = "http-api/openapi.json"
RESULTS = "bench/results"


# --- the experiment config ----------------------------------------------------------------------------------


def _comments(source: str) -> tuple[dict[int, str], list[str]]:
    """The comment on each line of ``source`` (without its ``#``), and the source's lines."""
    found = {tok.start[0]: tok.string.lstrip("#").strip()
             for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    return found, source.splitlines()


def _described(node: ast.stmt, comments: dict[int, str], lines: list[str]) -> str:
    """The comment lines right above ``node`` and the comment on its own lines, joined."""
    above, line = [], node.lineno - 1
    while line >= 1 and lines[line - 1].lstrip().startswith("#"):
        above.insert(0, comments[line])
        line -= 1
    beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    return "; ".join(part for part in (" ".join(above), " ".join(beside)) if part)


# The modules whose classes are config sections or a plug-in's parameters, and those whose constants their
# comments may name ("see NAME").
SOURCES = ("fedrod_ray/config/sections.py", *(f"fedrod_ray/specs/{m}.py" for m in ("rules", "methods", "losses")))
NAMED = (*SOURCES, "fedrod_ray/specs/models.py", "fedrod_ray/specs/datasets.py")


@functools.cache
def field_comments() -> dict[str, dict[str, str]]:
    """class name -> field -> its comment in SOURCES; "(see NAME)" gives the comment of constant NAME."""
    constants = {}
    for path in NAMED:
        source = (ROOT / path).read_text()
        comments, lines = _comments(source)
        constants |= {t.id: _described(node, comments, lines) for node in ast.parse(source).body
                      if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}

    def expand(text: str) -> str:
        """"(see NAME)" and "see NAME" as NAME's comment (without its own "key: "), Python's None as YAML's null."""
        text = re.sub(r"\s*\(?\bsee ([A-Z_]+)\)?", lambda m: ": " + re.sub(r"^[\w.]+: ", "", constants[m.group(1)])
                      if constants.get(m.group(1)) else m.group(0), text)
        return re.sub(r"\bNone\b", "null", text).removeprefix(": ")

    found = {}
    for path in SOURCES:
        source = (ROOT / path).read_text()
        comments, lines = _comments(source)
        found |= {cls.name: {stmt.target.id: expand(_described(stmt, comments, lines)) for stmt in cls.body
                             if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
                  for cls in ast.parse(source).body if isinstance(cls, ast.ClassDef)}
    return found


def _type(prop: dict) -> str:
    options = prop.get("anyOf", [prop])
    names = []
    for option in options:
        kind = option.get("type", "object")
        if kind == "array":
            kind = f"list of {option.get('items', {}).get('type', 'values')}"
        elif kind == "object" and isinstance(option.get("additionalProperties"), dict):
            kind = f"mapping to {option['additionalProperties'].get('type', 'values')}"
        elif kind == "object":
            kind = "mapping"
        names.append(kind)
    return " or ".join(names)


def _allowed(prop: dict) -> str:
    parts = []
    if "enum" in prop:
        parts.append(", ".join(f"`{v}`" for v in prop["enum"]))
    if "examples" in prop:
        parts.append("built in: " + ", ".join(f"`{v}`" for v in prop["examples"]) + "; or a plug-in's name")
    for key, sign in (("exclusiveMinimum", ">"), ("minimum", "≥"), ("exclusiveMaximum", "<"), ("maximum", "≤")):
        for option in prop.get("anyOf", [prop]):
            if key in option:
                parts.append(f"{sign} {option[key]:g}")
    return "; ".join(parts)


def _default(prop: dict, factory_default=None) -> str:
    """The schema's default, else (a default_factory's, which the schema leaves out) the dataclass's own."""
    return f"`{json.dumps(prop.get('default', factory_default))}`"


def _cell(text: str) -> str:
    """Text as one Markdown table cell: no column break, HTML tag, emphasis or reference link out of it."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*").replace("[", "\\[")


def _table(properties: dict, prefix: str, comments: dict[str, str], defaults: dict) -> list[str]:
    lines = ["| key | type | default | allowed | what it is |", "| --- | --- | --- | --- | --- |"]
    for name, prop in properties.items():
        if "$ref" in prop:
            continue
        lines.append(f"| `{prefix}{name}` | {_type(prop)} | {_default(prop, defaults[name])} | "
                     f"{_cell(_allowed(prop))} | {_cell(comments.get(name, ''))} |")
    return lines


def config_reference() -> str:
    """Markdown: a table per section of the experiment config, and the rules' parameters."""
    from pydantic import TypeAdapter

    from fedrod_ray.config import ExperimentConfig, config_schema
    from fedrod_ray.specs.methods import HEADS
    from fedrod_ray.specs.rules import RULES

    schema, comments, defaults = config_schema(), field_comments(), ExperimentConfig().to_dict()
    out = [f"{schema.get('description', '')}", "", "## Top level", "",
           *_table(schema["properties"], "", comments[schema["title"]], defaults)]
    for name, prop in schema["properties"].items():
        if "$ref" in prop.get("items", {}):  # a list of sections (sites): each item's keys
            item = schema["$defs"][prop["items"]["$ref"].rsplit("/", 1)[1]]
            out += ["", f"## `{name}`, each item", "", _cell(item.get("description", "")), "",
                    "| key | type | default | allowed | what it is |", "| --- | --- | --- | --- | --- |"]
            for key, p in item["properties"].items():
                default = "required" if key in item.get("required", ()) else _default(p)
                out.append(f"| `{name}[].{key}` | {_type(p)} | {default} | {_cell(_allowed(p))} | "
                           f"{_cell(comments[item['title']].get(key, ''))} |")
        if "$ref" not in prop:
            continue
        section = schema["$defs"][prop["$ref"].rsplit("/", 1)[1]]
        out += ["", f"## `{name}`", ""]
        if section.get("description"):
            out += [section["description"], ""]
        out += _table(section["properties"], f"{name}.", comments[section["title"]], defaults[name])
        for sub, subprop in section["properties"].items():
            if "$ref" in subprop:
                inner = schema["$defs"][subprop["$ref"].rsplit("/", 1)[1]]
                out += ["", f"### `{name}.{sub}`", "", inner.get("description", ""), "",
                        *_table(inner["properties"], f"{name}.{sub}.", comments[inner["title"]],
                                defaults[name][sub])]
    for key, what, specs in (("train.rule_params", "generic rule (`train.generic_rule`)", RULES),
                             ("train.head_params", "personalization method (`train.head`)", HEADS)):
        out += ["", f"## `{key}`, by {what.split(' (')[0].split()[-1]}", "",
                f"Each {what} takes its own parameters; a key it does not take is an error.", "",
                f"| `{what.split('`')[1]}` | `{key}` |", "| --- | --- |"]
        for name, spec in specs.items():
            props = TypeAdapter(spec.params).json_schema().get("properties", {})
            comment = comments.get(spec.params.__name__, {})
            cells = [f"`{k}`: {_type(p)}, default {_default(p)}, {_allowed(p)}; {_cell(comment.get(k, ''))}"
                     for k, p in props.items()]
            out.append(f"| `{name}` | {'<br>'.join(cells) or 'none'} |")
    return "\n".join(out)


# --- the command line ---------------------------------------------------------------------------------------


def _action_row(action: argparse.Action) -> str:
    flags = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        value = ""
    elif action.choices:
        value = " \\| ".join(f"`{c}`" for c in action.choices)
    else:
        value = f"`{action.metavar or action.dest.upper()}`"
    if action.required and action.option_strings:
        value += " (required)"
    default = action.default
    shown = "" if default in (None, [], False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    about = action.help or ""
    if "%(" in about:  # argparse's own placeholders, e.g. %(default)s
        about %= vars(action)
    return f"| {flags} | {value} | {shown} | {_cell(about)} |"


def _parser_section(parser: argparse.ArgumentParser, title: str, about: str) -> list[str]:
    out = [f"## `{title}`", ""]
    if about:
        out += [about[0].upper() + about[1:] + ".", ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    actions = [a for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if actions:
        out += ["| argument | value | default | what it does |", "| --- | --- | --- | --- |",
                *map(_action_row, actions)]
    return out


@contextlib.contextmanager
def _columns(width: int):
    """argparse wraps usage lines to the terminal's width: a fixed one, so the page is the same everywhere."""
    saved = {k: os.environ.get(k) for k in ("COLUMNS", "NO_COLOR")}
    os.environ.update(COLUMNS=str(width), NO_COLOR="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cli_reference() -> str:
    """Markdown: ``fedrod-ray`` and each of its subcommands, as the parser defines them."""
    from fedrod_ray.cli import build_parser

    with _columns(80):
        parser = build_parser()
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        about = {a.dest: a.help for a in sub._choices_actions}
        out = _parser_section(parser, "fedrod-ray", "")
        for name, command in sub.choices.items():
            out += [""] + _parser_section(command, f"fedrod-ray {name}", about.get(name, ""))
    return "\n".join(out)


# --- the HTTP API -------------------------------------------------------------------------------------------


@functools.cache
def openapi_document() -> dict:
    """The OpenAPI document of ``fedrod-ray serve`` for an MNIST-shaped hyper model (random weights)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from served import make_final  # the HTTP API tests' model: one way to build a final/, not two
    finally:
        sys.path.remove(str(ROOT / "tests"))
    from fedrod_ray_api.app import create_app

    with tempfile.TemporaryDirectory() as run_dir:
        make_final(run_dir, head="hyper")
        return create_app(run_dir).openapi()


def _schema_name(content: dict) -> str:
    schema = next(iter(content.values()), {}).get("schema", {})
    ref = schema.get("$ref") or next((s.get("$ref") for s in schema.get("anyOf", []) if "$ref" in s), "")
    return ref.rsplit("/", 1)[-1]


def _schema_link(name: str) -> str:
    return f"[`{name}`](#schema-{name.lower()})" if name else ""


def _json_type(prop: dict) -> str:
    """A property's JSON type, shortly: ``array of array of number``, ``TopClass``, ``string or null``."""
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " or ".join(dict.fromkeys(_json_type(option) for option in prop["anyOf"]))
    if prop.get("type") == "array":
        return f"array of {_json_type(prop.get('items', {}))}"
    if "enum" in prop:
        return " or ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    return prop.get("type", "any")


def http_api_reference() -> str:
    """Markdown: each operation of the OpenAPI document with its request body, answers and description."""
    doc = openapi_document()
    out = [(f"Generated from the OpenAPI document ([`openapi.json`]({OPENAPI_URI}), OpenAPI "
            f"{doc['openapi']}) of a server of an MNIST-shaped model with the hyper head: a served model's own "
            "document (`/openapi.json`) states its class count and image shape where this one says 10 and "
            "1 × 28 × 28."), "", "| operation | what it does | answers |", "| --- | --- | --- |"]
    details = []
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            title = f"{method.upper()} {path}"
            anchor = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
            codes = ", ".join(sorted(op.get("responses", {})))
            out.append(f"| [`{title}`](#{anchor}) | {_cell(op.get('summary', ''))} | {codes} |")
            details += ["", f"### `{title}` {{#{anchor}}}", ""]
            if op.get("description"):
                details += [op["description"].strip(), ""]
            body = op.get("requestBody", {}).get("content", {})
            if body:
                details += [f"Request body: {_schema_link(_schema_name(body)) or next(iter(body))}.", ""]
            details += ["| status | meaning | body |", "| --- | --- | --- |"]
            for code, answer in sorted(op.get("responses", {}).items()):
                details.append(f"| {code} | {_cell(answer.get('description', ''))} | "
                               f"{_schema_link(_schema_name(answer.get('content', {})))} |")
    details += ["", "### Schemas"]
    for name, schema in sorted(doc["components"]["schemas"].items()):
        required = set(schema.get("required", ()))
        details += ["", f"#### `{name}` {{#schema-{name.lower()}}}", ""]
        if schema.get("description"):
            details += [_cell(schema["description"].strip()), ""]
        details += ["| field | type | what it is |", "| --- | --- | --- |"]
        for field, prop in schema.get("properties", {}).items():
            mark = "" if field in required else " (optional)"
            details.append(f"| `{field}`{mark} | {_cell(_json_type(prop))} | {_cell(prop.get('description', ''))} |")
    return "\n".join(out + details)


# --- MkDocs events ------------------------------------------------------------------------------------------

GENERATORS = {"config-reference": config_reference, "cli-reference": cli_reference,
              "http-api": http_api_reference}


def on_files(files, config):
    files.append(File.generated(config, OPENAPI_URI, content=json.dumps(openapi_document(), indent=2)))
    for png in sorted((ROOT / RESULTS).glob("**/curves.png")):
        files.append(File.generated(config, png.relative_to(ROOT).as_posix(), abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    def generate(match: re.Match) -> str:
        if match.group(1) not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: no generator for {match.group(0)}")
        return GENERATORS[match.group(1)]()

    return MARKER.sub(generate, markdown).replace(f"](../{RESULTS}/", f"]({RESULTS}/")
