"""What every evaluation command shares: reading a run from its checkpoint, the plotting set-up,
the GOAT layers of a model, the chunked forward, undoing a failed command's writes, and the one-line
argument errors of the commands and scripts."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

__all__ = ["Run", "load_run", "read_checkpoint", "run_record_of", "import_class", "pyplot", "goat_layers",
           "chunked_logits", "undo_on_failure", "OneLineParser", "output_problem", "refuse_below", "check_device",
           "free_bytes"]

_DEFAULT_HEAD = "mixlab.heads.lm.CausalLM"


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose bad input is ONE line on stderr, ``<prog>: error: <message> (--help
    lists the options)``, exit status 2, without the usage block (as the training commands' errors): every
    ``python -m mixlab`` evaluation command and the scripts under ``scripts/`` use it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")

    def check_output(self, option: str, path: str | Path | None, folder: bool = False) -> None:
        """Refuse an output ``path`` that cannot be written, before any measurement (:func:`output_problem`; its
        missing folder is created). ``None`` (not given) passes. Exits as :meth:`error` (one line, status 2)."""
        problem = output_problem(option, path, folder, create=True)
        if problem:
            self.error(problem)


def output_problem(option: str, path: str | Path | None, folder: bool = False, create: bool = False) -> str | None:
    """Why an output ``path`` given as ``option`` cannot be written, in one line, or None when it can (or is
    ``None``, not given). The folder that would hold it (``folder``: ``path`` itself, else its parent) must take a
    new file: it is created when ``create``, else its nearest existing folder is tried. An empty string, a file
    where a folder is due, a folder where a file is due (a path ending in ``/`` too) and a name over 255 bytes
    are refused."""
    if path is None:
        return None
    if not str(path).strip():
        return f"{option} is empty; give a {'folder' if folder else 'file'} path"
    if not folder and str(path).endswith(("/", os.sep)):
        return f"{option} {str(path)!r} ends in '/' (a folder); give a file path"
    path = Path(path)
    long = next((part for part in path.parts if len(os.fsencode(part)) > 255), None)
    if long is not None:  # what Linux file systems take for one name (NAME_MAX)
        return f"{option} {str(path)!r} cannot be written: the name {long[:20]!r}... is over 255 bytes"
    where = path if folder else path.parent
    if not folder and path.is_dir():
        return f"{option} {str(path)!r} is a folder; give a file path"
    if folder and path.exists() and not path.is_dir():
        return f"{option} {str(path)!r} is a file; give a folder"
    above = next((d for d in [where, *where.parents] if d.exists()), None)
    if above is not None and not above.is_dir():
        return f"{option} {str(path)!r} cannot be written: {str(above)!r} is a file, not a folder"
    try:
        if create:
            where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where if create else above or Path.cwd(), prefix=".write-check-"):
            pass
    except OSError as err:
        return f"{option} {str(path)!r} cannot be written: {err.strerror or err}"
    return None


def refuse_below(*checks: tuple[str, Any, int | float]) -> None:
    """Refuse command-line options below their least value: each check is ``(option, value, least)``; a value
    of ``None`` is "not given" and passes.

    Raises:
        ValueError: ``<option> must be >= <least>; got <value>``, for the first option out of range.
    """
    for option, value, least in checks:
        if value is not None and value < least:
            raise ValueError(f"{option} must be >= {least}; got {value}")


def check_device(device: str | torch.device, option: str = "--device") -> torch.device:
    """The ``torch.device`` a command-line ``option`` names, checked before anything is loaded.

    Raises:
        ValueError: not a device name (``cpu``, ``cuda``, ``cuda:N``); CUDA on a machine without it; ``cuda:N``
            past the visible GPUs. The message names ``option`` and the value.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{option} {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{option} {device}: the evaluation commands run on cpu or cuda; got {dev.type}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{option} {device}: CUDA is not available on this machine; use {option} cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{option} {device}: this machine has {torch.cuda.device_count()} GPU(s) (cuda:0 .. "
                         f"cuda:{torch.cuda.device_count() - 1})")
    return dev


def import_class(path: str) -> type:
    """``"pkg.module.Class"`` -> the class."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def run_record_of(checkpoint: dict) -> tuple[str | None, str | None, dict[str, Any]]:
    """``(head class path, datamodule class path, datamodule arguments)`` recorded in a checkpoint
    dict; None where it records nothing.

    Reads ``checkpoint["mixlab"]`` (:func:`mixlab.heads.common.run_record`, written by every head)
    and falls back, for checkpoints written before it, to ``mixlab_class_path`` (SyntheticLM),
    ``mixlab_datamodule`` (ImageClassifier) and LightningCLI's ``_class_path`` entries in
    ``hyper_parameters`` / ``datamodule_hyper_parameters``.
    """
    from mixlab.heads.common import CHECKPOINT_KEY

    record = checkpoint.get(CHECKPOINT_KEY) or {}
    hp = checkpoint.get("hyper_parameters") or {}
    head = record.get("head") or checkpoint.get("mixlab_class_path") or hp.get("_class_path")
    if "data" in record:
        data, args = record["data"], dict(record.get("data_args") or {})
    elif checkpoint.get("mixlab_datamodule"):
        old = checkpoint["mixlab_datamodule"]
        data, args = old["class_path"], dict(old["init_args"])
    else:
        args = dict(checkpoint.get("datamodule_hyper_parameters") or {})
        data = args.pop("_class_path", None)
    return head, data, {k: v for k, v in args.items() if not str(k).startswith("_")}


@dataclass
class Run:
    """A trained run read back from its checkpoint (:func:`load_run`).

    Attributes:
        path: the checkpoint file.
        model: the head, in eval mode on the requested device.
        head: the head's class path.
        data: the datamodule's class path, or None when the checkpoint records none.
        data_args: the datamodule's constructor arguments.
        step: the checkpoint's ``global_step``.
    """

    path: Path
    model: pl.LightningModule
    head: str
    data: str | None
    data_args: dict[str, Any] = field(default_factory=dict)
    step: int = 0

    def datamodule(self, default: str | None = None, **overrides: Any) -> Any:
        """The run's datamodule rebuilt with ``overrides`` applied to its arguments (not set up).

        Args:
            default: class path used when the checkpoint records no datamodule.

        Raises:
            ValueError: the checkpoint records no datamodule and there is no ``default`` (names ``--ckpt``).
        """
        path = self.data or default
        if path is None:
            raise ValueError(f"--ckpt {self.path}: the checkpoint records no datamodule (train with the mixlab CLI "
                             f"or with a datamodule attached to the Trainer)")
        return import_class(path)(**{**self.data_args, **overrides})


def _checkpoints_below(folder: Path, depth: int = 4, most: int = 2000) -> list[Path]:
    """``.ckpt`` files at most ``depth`` folders below ``folder`` (a run root's ``<task>/<run>/version_N/checkpoints``
    is 4), looking into at most ``most`` folders: a folder such as ``/`` is not walked whole."""
    found: list[Path] = []
    level, seen = [folder], 0
    for _ in range(depth + 1):
        below: list[Path] = []
        for d in level:
            seen += 1
            if seen > most:
                return found
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            found += [Path(e.path) for e in entries if e.name.endswith(".ckpt") and e.is_file()]
            below += [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
        level = below
    return found


def read_checkpoint(path: str | Path, option: str = "--ckpt") -> dict:
    """The Lightning checkpoint dict at ``path`` (memory-mapped, tensors not copied), for the command-line
    option ``option`` that named it (``--ckpt``, ``--ckpt_path``), which every error message starts with.

    Raises:
        FileNotFoundError: no such file, or a directory (the message names a checkpoint below it, if any).
        ValueError: not a ``torch.save`` zip archive, unreadable, or no ``state_dict`` (not written by
            Lightning); the message names the file and the reason.
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(_checkpoints_below(path), key=lambda p: (p.name == "last.ckpt", p.stat().st_mtime))
        example = f"e.g. {found[-1]}" if found else "no .ckpt file within 4 folders below it"
        raise FileNotFoundError(f"{option} {path}: a directory; give a checkpoint file ({example})")
    if not path.is_file():
        raise FileNotFoundError(f"{option} {path}: file not found")
    hint = "give a .ckpt file written by python -m mixlab fit"
    if not zipfile.is_zipfile(path):  # torch's own message for this case suggests re-saving the file
        with open(path, "rb") as fh:
            truncated = fh.read(4) == b"PK\x03\x04"  # a zip archive's start without its end
        if truncated:
            raise ValueError(f"{option} {path}: a truncated or damaged checkpoint (the start of a torch.save archive "
                             f"without its end: a save or copy that did not finish); {hint}")
        raise ValueError(f"{option} {path}: not a PyTorch Lightning checkpoint (not a torch.save zip archive); {hint}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError ... for damaged files
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]  # torch's first line, whole
        raise ValueError(f"{option} {path}: not a readable PyTorch Lightning checkpoint ({why}); {hint}") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{option} {path}: not a PyTorch Lightning checkpoint (no state_dict); {hint}")
    return checkpoint


def load_run(ckpt: str | Path, device: str | torch.device = "cpu", head: type | None = None,
             hint: str = "") -> Run:
    """Read a mixlab run from a Lightning checkpoint (CLI or plain ``Trainer`` runs, old or new).

    The head class comes from the checkpoint's run record (:func:`run_record_of`); without one,
    ``head`` (else :class:`~mixlab.heads.lm.CausalLM`). The model is loaded in eval mode on ``device``.

    Args:
        head: the head class the command needs; a checkpoint of another head is an error.
        hint: that error's explanation (default: ``"expected a <head> run"``).

    Raises:
        FileNotFoundError: no such file, or a directory (:func:`read_checkpoint`).
        ValueError: the file is not a Lightning checkpoint; ``device`` is not a device this machine has
            (:func:`check_device`); the checkpoint's head is not a ``head`` (``"--ckpt <path>: a <class> checkpoint;
            <hint>"``).
    """
    path = Path(ckpt)
    check_device(device)
    raw = read_checkpoint(path, "--ckpt")
    head_path, data, data_args = run_record_of(raw)
    if head_path is None:
        head_path = f"{head.__module__}.{head.__qualname__}" if head is not None else _DEFAULT_HEAD
    cls = import_class(head_path)
    if head is not None and not issubclass(cls, head):
        raise ValueError(f"--ckpt {ckpt}: a {head_path} checkpoint; {hint or f'expected a {head.__name__} run'}")
    try:
        model = cls.load_from_checkpoint(path, map_location=device, weights_only=False)
    except RuntimeError as err:
        if "state_dict" not in str(err).split("\n", 1)[0]:
            raise
        from mixlab.cli import state_dict_mismatch

        raise ValueError(f"--ckpt {ckpt}: its weights do not fit the {head_path} it records "
                         f"({state_dict_mismatch(err)}); a damaged or hand-edited checkpoint?") from None
    return Run(path, model.eval().to(device), head_path, data, data_args, int(raw.get("global_step", 0)))


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (PNG output, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def goat_layers(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer index: GoatPrior}`` of every GOAT attention layer of a model (ALiBi excluded):
    the mixers that describe themselves as ``position: goat`` (:meth:`mixlab.mixers.base.Mixer.describe`)."""
    from mixlab.mixers.base import Mixer

    mixers = [m for m in model.modules() if isinstance(m, Mixer)]
    return {int(getattr(m, "layer_idx", i)): m.pos for i, m in enumerate(mixers)
            if m.describe().get("position") == "goat"}


@torch.no_grad()
def chunked_logits(model, tokens: Tensor, chunk: int | None = None):
    """Yield ``(start, logits [B, c, V])`` for ``tokens [B, T]``, ``c <= chunk`` tokens at a time.

    With ``chunk`` (and ``chunk < T``) the sequence is fed chunk by chunk through the
    per-layer caches (``caches=[{} for each layer]``), which for attention is exact and
    keeps the logits memory at ``B * chunk * V``; otherwise one plain forward.

    Raises:
        ValueError: ``chunk < 0``.
    """
    if chunk is not None and chunk < 0:
        raise ValueError(f"chunk must be >= 0 tokens (0 or None: one plain forward); got {chunk}")
    t = tokens.shape[1]
    if not chunk or chunk >= t:
        yield 0, model(tokens)
        return
    caches = [{} for _ in model.backbone.blocks]
    for s in range(0, t, chunk):
        yield s, model(tokens[:, s:s + chunk], None, caches)


@contextlib.contextmanager
def undo_on_failure(keep: tuple[str, ...] = (".png", ".csv", ".md")) -> Iterator[Callable[[str | Path], Path]]:
    """``with undo_on_failure() as note:`` a command's writes; ``note(folder)`` (returns it) is called before
    the body first writes into ``folder``. If the body raises (any exception, Ctrl-C), every noted folder is
    put back as it was when noted, then the same exception propagates.

    A folder that existed loses the files the body added directly in it (event files, PNGs, tables) and gets
    back the earlier contents of its files with a suffix in ``keep`` (outputs the body may overwrite); all
    else in it stays (subfolders are their own ``note``). A folder that did not exist is removed with
    everything in it, and so are the parents created for it. Errors while cleaning up are ignored: the
    body's error is the one raised.

    ``replace`` (TensorBoard folders): when the body succeeds, event files ``folder`` held when noted are removed,
    so that a repeated evaluation's scalars replace the earlier ones instead of being shown twice (on failure
    they stay, as everything else). ``replace=True``: all of them (a folder only the command writes);
    ``replace="tags"``: those that hold only tags the body's new event files hold too (a run's shared folder:
    training logs and other commands' tags stay; :func:`replace_events`).
    """
    noted: list[tuple[Path, set[str] | None, dict[Path, bytes]]] = []
    replaced: list[tuple[Path, set[Path], bool]] = []  # (folder, its event files when noted, by tags)

    def note(folder: str | Path, replace: bool | str = False) -> Path:
        if replace not in (False, True, "tags"):
            raise ValueError(f"replace must be False, True or 'tags'; got {replace!r}")
        folder = Path(folder).absolute()
        if replace and folder.is_dir():
            replaced.append((folder, {f for f in folder.glob("events.out.tfevents.*") if f.is_file()},
                             replace == "tags"))
        if folder.is_dir():
            files = list(folder.iterdir())
            noted.append((folder, {f.name for f in files},
                          {f: f.read_bytes() for f in files if f.suffix in keep and f.is_file()}))
        elif not folder.exists():
            top = folder
            while not top.parent.exists():  # the highest folder the body creates for it
                top = top.parent
            noted.append((top, None, {}))
        return folder

    try:
        yield note
    except BaseException:
        for folder, names, saved in reversed(noted):
            with contextlib.suppress(OSError):
                if names is None:
                    if folder.is_dir():
                        shutil.rmtree(folder)
                    continue
                for f in folder.iterdir():
                    if f.name not in names and f.is_file():
                        f.unlink()
                for f, data in saved.items():
                    if not f.is_file() or f.read_bytes() != data:
                        f.write_bytes(data)
        raise
    for folder, earlier, by_tags in replaced:  # the command succeeded: its events replace the earlier call's
        with contextlib.suppress(OSError):
            replace_events(folder, earlier, by_tags)


def _event_tags(path: Path) -> set[str]:
    """Tags of the summaries in one TensorBoard event file; empty when it cannot be read or is over 64 MiB (not
    an evaluation command's: a few PNGs and scalars)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    try:
        if path.stat().st_size > 64 * 2 ** 20:
            return set()
        return {v.tag for e in EventFileLoader(str(path)).Load() if e.HasField("summary") for v in e.summary.value}
    except Exception:  # a damaged or foreign file: keep it
        return set()


def replace_events(tb: str | Path, earlier: set[Path], by_tags: bool = True) -> list[Path]:
    """After a command succeeded: remove the event files of ``tb`` that were there before it (``earlier``), so
    TensorBoard shows its images and scalars once. ``by_tags``: only those that hold nothing but tags the
    command has just written again (the same figure run again); event files with other tags (other figures,
    heads, training logs) or none stay. Returns those removed (sorted)."""
    tags = set().union(*(_event_tags(f) for f in set(Path(tb).glob("events.out.tfevents.*")) - earlier)) \
        if by_tags else set()
    removed = []
    for f in sorted(earlier):
        old = _event_tags(f) if by_tags else None
        if not by_tags or (old and old <= tags):
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


def free_bytes(device: str | torch.device) -> int:
    """Free memory on ``device`` in bytes: CUDA's free bytes (``torch.cuda.mem_get_info``); on the host
    ``MemAvailable`` of ``/proc/meminfo`` (page cache counts as free), else the available physical pages; ``2**62``
    (no check) where neither can be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no check
        return 1 << 62
