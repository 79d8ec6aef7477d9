"""Write WebDataset shards (timm convention: ``__key__``, ``jpg``, ``cls``) from an ImageFolder tree.

    python scripts/make_wds_shards.py /data/imagenet/train /data/imagenet/wds/imagenet1k-train-%04d.tar --maxcount 1252
    python scripts/make_wds_shards.py /data/imagenet/val   /data/imagenet/wds/imagenet1k-validation-%04d.tar \
        --maxcount 782 --classes-from /data/imagenet/train

(1,281,167 and 50,000 images: 1,024 and 64 shards, the patterns ``configs/vit/goat_imagenet.yaml`` reads.)

Classes are the sorted sub-folder names (torchvision ImageFolder's mapping; ``classes.txt`` is written
next to the shards). JPEG files are copied byte for byte, other formats re-encoded as JPEG. Samples are
shuffled (``--seed``) so every shard holds a class mix. Write at least ``n_gpus x num_workers`` shards
per split. Read them back with ``mixlab.datamodules.imagenet.ImageNetDataModule(format="wds",
train_path="/data/imagenet/wds/imagenet1k-train-{0000..1023}.tar", ...)``. Use the train folder's classes for
validation (``--classes-from``) so both splits share one label mapping. Shards of the pattern that exist
already are refused (a glob would read old and new together); ``--overwrite`` removes them first.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

from mixlab.datamodules.imagenet import check_shard_pattern, write_imagefolder_shards
from mixlab.eval.common import OneLineParser


def existing_shards(pattern: str) -> list[Path]:
    """The files that ``pattern``'s printf field (``%04d``) could have written: its name with any number there."""
    path = Path(pattern)
    field = re.search(r"%0?\d*d", path.name)
    if field is None or not path.parent.is_dir():
        return []
    name = re.compile(re.escape(path.name[:field.start()]) + r"\d+" + re.escape(path.name[field.end():]))
    return sorted(f for f in path.parent.iterdir() if f.is_file() and name.fullmatch(f.name))


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="ImageFolder root: <root>/<class>/<image>")
    p.add_argument("pattern", help="output shard pattern with a printf field, e.g. out/imagenet1k-train-%%04d.tar")
    p.add_argument("--maxcount", type=int, default=1000, help="samples per shard")
    p.add_argument("--seed", type=int, default=0, help="sample shuffle seed (-1: keep folder order)")
    p.add_argument("--overwrite", action="store_true",
                   help="remove the shards of PATTERN that exist already, then write (default: refuse)")
    p.add_argument("--classes-from", default=None,
                   help="ImageFolder root (or classes.txt) defining the class -> label mapping (default: root)")
    a = p.parse_args(argv)
    if not Path(a.root).is_dir():
        p.error(f"root {a.root!r} is not a directory (an ImageFolder root: <root>/<class>/<image>)")
    if a.classes_from and not Path(a.classes_from).exists():
        p.error(f"--classes-from {a.classes_from!r} does not exist")
    try:
        check_shard_pattern(a.pattern)
    except ValueError as err:
        p.error(str(err))
    if a.maxcount < 1:
        p.error(f"--maxcount must be >= 1 samples per shard; got {a.maxcount}")
    mapping = None
    if a.classes_from:
        src = Path(a.classes_from)
        names = src.read_text().split() if src.is_file() else sorted(d.name for d in src.iterdir() if d.is_dir())
        mapping = {c: i for i, c in enumerate(names)}
        missing = sorted(d.name for d in Path(a.root).iterdir() if d.is_dir() and d.name not in mapping)
        if missing:
            p.error(f"--classes-from {a.classes_from!r}: {len(missing)} class folder(s) of {a.root!r} are not in its "
                    f"mapping (first: {', '.join(missing[:5])}); use the training root or its classes.txt")
    old = existing_shards(a.pattern)
    if old and not a.overwrite:
        p.error(f"pattern {a.pattern!r}: {len(old)} shards exist already ({old[0]} ..): a glob would read them with "
                f"the new ones; pass --overwrite to remove them first, or choose another pattern")
    def remove_old() -> None:  # only once the root passed the writer's checks: a bad root removes nothing
        for f in old:
            f.unlink()

    try:
        with warnings.catch_warnings(record=True) as caught:  # counted for the summary line, then shown
            warnings.simplefilter("always")
            shards = write_imagefolder_shards(a.root, a.pattern, a.maxcount, None if a.seed < 0 else a.seed, mapping,
                                              before_write=remove_old)
    except (FileNotFoundError, ValueError) as err:
        p.error(str(err))
    for w in caught:
        print(f"{w.category.__name__}: {w.message}", file=sys.stderr)
    skipped = sum("not a readable image" in str(w.message) for w in caught)
    first, last = shards[0], shards[-1]
    print((f"wrote 1 shard: {first}" if len(shards) == 1 else f"wrote {len(shards)} shards: {first} .. {last}")
          + (f" ({skipped} unreadable file(s) skipped, named above)" if skipped else ""))
    digits = len(Path(first).stem.rsplit("-", 1)[-1]) if "-" in Path(first).stem else 0
    if digits:
        stem = str(Path(first)).rsplit("-", 1)[0]
        print(f"brace pattern: {stem}-{{{0:0{digits}d}..{len(shards) - 1:0{digits}d}}}.tar")


if __name__ == "__main__":
    main()
