"""Failure injection for the "a failed command leaves its output folder as it was" tests."""

from __future__ import annotations

from pathlib import Path


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def fail_on_call(monkeypatch, owner, name: str, n: int = 2) -> list[int]:
    """Replace ``owner.<name>`` so that its ``n``-th call raises ``RuntimeError("evaluation failed")`` (the calls
    before it run the real function); returns the list that counts the calls."""
    real, calls = getattr(owner, name), []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("evaluation failed")
        return real(*a, **k)

    monkeypatch.setattr(owner, name, failing)
    return calls
