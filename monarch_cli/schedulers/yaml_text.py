"""The YAML backends print and hand over (Kubernetes manifests, the SkyPilot task): PyYAML's safe dumper, with
keys in the order they were built, scripts as ``|`` block literals, nested lists indented and no line folding,
so a dry run reads like a hand-written file. PyYAML is imported on first use: only a plan that prints YAML pays."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _dumper() -> type:
    import yaml

    class Dumper(yaml.SafeDumper):
        def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
            super().increase_indent(flow, False)  # "ports:\n  - name: agent", as kubectl writes it

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return Dumper


def dump(data: Any) -> str:
    """One YAML document."""
    return dump_all([data], explicit_start=False)


def dump_all(documents: list[Any], *, explicit_start: bool = True) -> str:
    """Several YAML documents, each after ``---``."""
    import yaml

    return yaml.dump_all(
        documents,
        Dumper=_dumper(),
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=1 << 16,
        explicit_start=explicit_start,
    )


__all__ = ["dump", "dump_all"]
