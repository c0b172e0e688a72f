"""The click that typer uses: typer >= 0.23 vendors its own copy (``typer._click``), older ones use click."""

try:
    from typer import _click as click  # type: ignore[attr-defined]
except ImportError:  # typer < 0.23
    import click  # type: ignore[no-redef]

__all__ = ["click"]
