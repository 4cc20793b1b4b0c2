"""The configuration reference, generated from the pydantic schema (so it cannot drift).

    python -m proxy.schema_doc            # print the Markdown table
    python -m proxy.schema_doc --write README.md   # replace the marked section of a file
"""
from __future__ import annotations

import argparse
import re
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from proxy.config import ProxyConfig

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def _type_name(annotation: object) -> str:
    # on 3.10 a parametrised builtin (list[str]) is also an instance of `type`: spell it out
    plain = isinstance(annotation, type) and typing.get_origin(annotation) is None
    text = annotation.__name__ if plain else repr(annotation)
    text = re.sub(r"\b(typing|proxy\.config)\.", "", text)
    return text.replace("NoneType", "null").replace("|", " \\| ")


def _model_of(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and typing.get_origin(annotation) is None and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = _model_of(field.annotation)
        is_list = typing.get_origin(field.annotation) is list or "list[" in repr(field.annotation)
        is_dict = typing.get_origin(field.annotation) is dict
        if nested is not None:
            key = path + ("[]" if is_list else ".<name>" if is_dict else "")
            doc = " ".join((nested.__doc__ or "").split("\n\n")[0].split())
            if is_dict and field.description:
                doc = field.description
            out.append((key, nested.__name__, _default(field) if is_list else "", doc))
            out.extend(rows(nested, key + "."))
            continue
        out.append((path, _type_name(field.annotation), _default(field), field.description or ""))
    return out


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    return _show(value).replace("|", "\\|")


def _show(value: object) -> str:
    """A plugin spec by its name (the routing profiles' defaults), anything else by its repr."""
    if isinstance(value, list) and value and all(isinstance(v, BaseModel) and hasattr(v, "type") for v in value):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, BaseModel) and hasattr(value, "type"):
        return repr(getattr(value, "type"))
    return repr(value)


def plugin_rows() -> list[tuple[str, str, str, str]]:
    """(kind, name, parameters, what it does) of every registered routing plugin."""
    from proxy.routing.plugins import KINDS, REGISTRY, lookup

    lookup("filter", "available")  # registers the built-ins
    out = []
    for kind in KINDS:
        for (k, name), plugin in sorted(REGISTRY.items()):
            if k != kind:
                continue
            if plugin.section is not None:
                params = f"those of `routing.{plugin.section}` (as defaults)"
            else:
                params = "; ".join(f"`{p}` ({t}, {d}): {m}" for p, t, d, m in rows(plugin.Params)) or "none"
            doc = " ".join((plugin.__doc__ or "").split("\n\n")[0].split())
            out.append((kind, name, params.replace("|", "\\|"), doc))
    return out


def markdown() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{p}` | {t} | {d} | {m} |" for p, t, d, m in rows(ProxyConfig)]
    lines += ["", "Routing plugins, for `routing.profiles` (proxy/routing/):", "",
              "| kind | name | params | what it does |", "|---|---|---|---|"]
    lines += [f"| {k} | `{n}` | {p} | {m} |" for k, n, p, m in plugin_rows()]
    return "\n".join(lines)


def write(path: Path) -> bool:
    """Replace the marked section; returns whether the file changed."""
    text = path.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    updated = text[:start] + "\n" + markdown() + "\n" + text[end:]
    if updated != text:
        path.write_text(updated)
    return updated != text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", metavar="FILE")
    args = parser.parse_args()
    if args.write:
        print("updated" if write(Path(args.write)) else "up to date")
    else:
        sys.stdout.write(markdown() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
