"""Four-image spatial VQA with held-out scan orders (GOAT paper, Sec. 6, Tables 9-10).

A *scene* is four images of four distinct classes on a canonical 2x2 grid (cells
``0 = top-left, 1 = top-right, 2 = bottom-left, 3 = bottom-right``). Every image is cut
into ``s x s`` patches (``s = patches_per_side = image_size // patch_size``), so the scene
is a canvas of ``W x W`` patches, ``W = 2 s``, with canonical patch index ``k = y W + x``
(units: patches; ``y = cell_row * s + patch_row``, ``x`` likewise).

The model reads the ``N = W^2`` patches in a *scan order* (a permutation of ``k``), then
a question of ``Q = 5`` words and an answer-query token ``<ans>``:

* ``what is at the <pos>``          -> the class word of the image at ``<pos>``
* ``where is the <class> ?``        -> a position word (``top-left`` ...)
* ``what is <rel> of <class>``      -> the class word of the neighbour of ``<class>`` in
  direction ``<rel>`` (``left``, ``right``, ``above``, ``below``; only existing neighbours)

Scan orders come from a named family (:func:`scan_order`): patch-level canvas orders
(``row_major``, ``col_major``, ``snake_rows``, ``snake_cols``, ``reversed``,
``reversed_col``, ``diagonal``, ``antidiagonal``, ``spiral``), image-by-image orders
``cells_ABCD`` (cells in the order of the four digits, patches row-major inside a cell)
and seeded random patch permutations ``perm<k>``. Training and validation scenes use
``train_orders`` only; test scenes cycle through ``train_orders + heldout_orders`` so the
test set measures seen vs held-out orders on the same scene distribution.

Coordinates (3 axes, ``Coords`` convention: axis 0 = sequence): text tokens have only the
sequence axis (their index in the flattened sequence, ``N + q``); image patches have the
canonical ``(y, x)`` and, with ``image_seq_axis=True``, also their scan index.

Every scene is a pure function of ``(seed, split, index)`` (``numpy.random.default_rng``),
so datasets are deterministic, independent of access order and of the number of workers.

Image sources: the UCI digits shipped with mixlab (default, 8x8 grey, offline) and
CIFAR-10 read from the user's disk in torchvision's python-pickle format
(``<root>/cifar-10-batches-py``); nothing is ever downloaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mixlab.distributed import ResumableDataModule, SplitLoaders, check_num_workers, check_seed

log = logging.getLogger("mixlab.spatial_vqa")

__all__ = [
    "CELL_NAMES", "RELATIONS", "QUESTION_TYPES", "DIGIT_NAMES", "CIFAR10_NAMES",
    "DEFAULT_TRAIN_ORDERS", "DEFAULT_HELDOUT_ORDERS",
    "scan_order", "canonical_coords", "patchify", "ask", "Vocab",
    "ImagePool", "digits_pool", "cifar10_pool", "SpatialVQADataset", "SpatialVQADataModule",
]

CELL_NAMES = ("top-left", "top-right", "bottom-left", "bottom-right")
RELATIONS = {"left": (0, -1), "right": (0, 1), "above": (-1, 0), "below": (1, 0)}
"""``<rel>`` word -> (row, col) step from the named object to the answer's cell."""
QUESTION_TYPES = ("what_at", "where", "relation")
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
ANSWER_TOKEN = "<ans>"
TEMPLATE_WORDS = ("what", "is", "at", "the", "where", "of", "?")
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}

DEFAULT_TRAIN_ORDERS = ("row_major", "snake_rows", "reversed", "diagonal",
                        "cells_0123", "cells_1032", "cells_2301", "cells_0213", "perm0", "perm1")
DEFAULT_HELDOUT_ORDERS = ("col_major", "snake_cols", "reversed_col", "antidiagonal", "spiral",
                          "cells_3210", "cells_1302", "cells_0312", "perm2", "perm3")
_CANVAS_ORDERS = ("row_major", "col_major", "snake_rows", "snake_cols", "reversed", "reversed_col",
                  "diagonal", "antidiagonal", "spiral")


# ---------------------------------------------------------------------------- scan orders
def canonical_coords(patches_per_side: int) -> np.ndarray:
    """``[N, 2]`` int64 canonical ``(y, x)`` of canvas patch ``k = y W + x`` (``W = 2 s``)."""
    w = 2 * patches_per_side
    y, x = np.divmod(np.arange(w * w, dtype=np.int64), w)
    return np.stack([y, x], axis=-1)


def _spiral(w: int) -> np.ndarray:
    top, left, bottom, right, out = 0, 0, w - 1, w - 1, []
    while top <= bottom and left <= right:
        out += [top * w + x for x in range(left, right + 1)]
        out += [y * w + right for y in range(top + 1, bottom + 1)]
        if top < bottom:
            out += [bottom * w + x for x in range(right - 1, left - 1, -1)]
        if left < right:
            out += [y * w + left for y in range(bottom - 1, top, -1)]
        top, left, bottom, right = top + 1, left + 1, bottom - 1, right - 1
    return np.asarray(out, dtype=np.int64)


def scan_order(name: str, patches_per_side: int) -> np.ndarray:
    """Scan order ``name`` as ``[N]`` int64 canonical patch indices (position t reads patch ``order[t]``).

    Names: ``row_major``, ``col_major``, ``snake_rows`` (boustrophedon rows),
    ``snake_cols``, ``reversed`` (row-major backwards), ``reversed_col``, ``diagonal``
    (anti-diagonals ``x + y`` from the top-left), ``antidiagonal`` (diagonals from the
    top-right), ``spiral`` (clockwise, outside in), ``cells_ABCD`` (image by image, cells
    in the order of the digits ``A..D``, a permutation of ``0123``, patches row-major
    inside a cell), ``perm<k>`` (uniform random permutation from seed ``k``).

    Raises:
        ValueError: unknown name (the message lists the family) or a bad ``cells_`` digit string.
    """
    s = int(patches_per_side)
    if s < 1:
        raise ValueError(f"patches_per_side must be >= 1; got {patches_per_side}")
    w = 2 * s
    yx = canonical_coords(s)
    y, x = yx[:, 0], yx[:, 1]
    if name == "row_major":
        return np.lexsort((x, y))
    if name == "col_major":
        return np.lexsort((y, x))
    if name == "snake_rows":
        return np.lexsort((np.where(y % 2 == 0, x, w - 1 - x), y))
    if name == "snake_cols":
        return np.lexsort((np.where(x % 2 == 0, y, w - 1 - y), x))
    if name == "reversed":
        return np.lexsort((x, y))[::-1].copy()
    if name == "reversed_col":
        return np.lexsort((y, x))[::-1].copy()
    if name == "diagonal":
        return np.lexsort((y, x + y))
    if name == "antidiagonal":
        return np.lexsort((y, (w - 1 - x) + y))
    if name == "spiral":
        return _spiral(w)
    if name.startswith("cells_"):
        digits = name[len("cells_"):]
        if sorted(digits) != ["0", "1", "2", "3"]:
            raise ValueError(f"scan order {name!r}: 'cells_' must be followed by a permutation of 0123, "
                             f"e.g. cells_2301")
        cell = (y // s) * 2 + (x // s)
        rank = np.empty(4, dtype=np.int64)
        rank[[int(c) for c in digits]] = np.arange(4)
        return np.lexsort((x % s, y % s, rank[cell]))
    if name.startswith("perm") and name[4:].isdigit():
        return np.random.default_rng(int(name[4:])).permutation(w * w).astype(np.int64)
    raise ValueError(f"unknown scan order {name!r}; choose from {', '.join(_CANVAS_ORDERS)}, "
                     f"cells_ABCD (a permutation of 0123) or perm<seed>")


# ---------------------------------------------------------------------------- questions
def ask(classes: Sequence[int], qtype: str, subject: int, relation: str | None = None,
        class_names: Sequence[str] = DIGIT_NAMES) -> tuple[list[str], str]:
    """Question words and answer word for a scene.

    Args:
        classes: class id of the image in each cell ``[4]`` (top-left, top-right,
            bottom-left, bottom-right); four distinct ids.
        qtype: ``what_at`` (``subject`` = a cell 0..3), ``where`` (``subject`` = a class id
            in the scene) or ``relation`` (``subject`` = a class id, ``relation`` one of
            ``left``/``right``/``above``/``below``: "what is <relation> of <subject>").
        class_names: word for each class id.

    Returns:
        ``(words, answer)``: five question words (without ``<ans>``) and the answer word.

    Raises:
        ValueError: unknown ``qtype``/``relation``, a class not in the scene, a relation
            pointing off the 2x2 grid, or repeated classes.
    """
    classes = [int(c) for c in classes]
    if len(classes) != 4 or len(set(classes)) != 4:
        raise ValueError(f"a scene needs four distinct classes; got {classes}")
    if qtype == "what_at":
        if not 0 <= subject < 4:
            raise ValueError(f"what_at: subject must be a cell 0..3; got {subject}")
        return ["what", "is", "at", "the", CELL_NAMES[subject]], class_names[classes[subject]]
    if subject not in classes:
        raise ValueError(f"{qtype}: class {subject} is not in the scene {classes}")
    cell = classes.index(subject)
    if qtype == "where":
        return ["where", "is", "the", class_names[subject], "?"], CELL_NAMES[cell]
    if qtype == "relation":
        if relation not in RELATIONS:
            raise ValueError(f"relation must be one of {sorted(RELATIONS)}; got {relation!r}")
        dr, dc = RELATIONS[relation]
        r, c = divmod(cell, 2)
        r, c = r + dr, c + dc
        if not (0 <= r < 2 and 0 <= c < 2):
            raise ValueError(f"nothing is {relation} of the {CELL_NAMES[cell]} image")
        return ["what", "is", relation, "of", class_names[subject]], class_names[classes[2 * r + c]]
    raise ValueError(f"unknown question type {qtype!r}; choose from {QUESTION_TYPES}")


@dataclass(frozen=True)
class Vocab:
    """Word and answer vocabularies for one set of class names.

    ``words``: ``<ans>``, template words, cell words, relation words, class names (ids are
    list indices). ``answers``: class names then cell words (answer ids index this list).
    """

    class_names: tuple[str, ...]

    @property
    def words(self) -> tuple[str, ...]:
        return (ANSWER_TOKEN,) + TEMPLATE_WORDS + CELL_NAMES + tuple(RELATIONS) + tuple(self.class_names)

    @property
    def answers(self) -> tuple[str, ...]:
        return tuple(self.class_names) + CELL_NAMES

    def encode(self, words: Sequence[str]) -> list[int]:
        index = {w: i for i, w in enumerate(self.words)}
        return [index[w] for w in words]

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.words[int(i)] for i in ids]


# ---------------------------------------------------------------------------- image sources
@dataclass
class ImagePool:
    """Images cut into patches, one pool per split of the source.

    Attributes:
        patches: uint8 ``[M, s*s, C*p*p]``: image ``m``'s patches in row-major order, each
            flattened channel-major (``C, p, p``), raw 0..255 values.
        labels: int64 ``[M]`` class ids.
        mean, std: per-channel float normalisation (applied after ``/255``).
    """

    patches: np.ndarray
    labels: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]


def patchify(images: np.ndarray, patch_size: int) -> np.ndarray:
    """``[M, C, H, W]`` -> ``[M, (H/p)(W/p), C p p]`` (patches row-major, channel-major inside).

    Raises:
        ValueError: ``H`` or ``W`` not divisible by ``patch_size``, or a non-square image.
    """
    m, c, h, w = images.shape
    if h != w:
        raise ValueError(f"spatial VQA needs square images; got {h}x{w}")
    if patch_size < 1 or h % patch_size:
        raise ValueError(f"patch_size={patch_size} does not divide the image size {h}")
    s = h // patch_size
    x = images.reshape(m, c, s, patch_size, s, patch_size).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(m, s * s, c * patch_size * patch_size))


def digits_pool(patch_size: int, test_fraction: float = 0.2, seed: int = 0,
                path: str | None = None) -> dict[str, ImagePool]:
    """UCI digits (``[M, 1, 8, 8]``, 0..255) split into ``train`` / ``test`` image pools.

    Test scenes use only ``test`` images (a seeded ``test_fraction`` of the 1,797).
    """
    from mixlab.datamodules.digits import load_uci_digits

    images, labels = load_uci_digits(path)
    images, labels = images.numpy()[:, None], labels.numpy()
    perm = np.random.default_rng([seed, 8]).permutation(len(labels))
    n_test = int(round(len(labels) * test_fraction))
    idx = {"test": perm[:n_test], "train": perm[n_test:]}
    pp = patchify(images, patch_size)
    return {k: ImagePool(pp[v], labels[v], (0.5,), (0.5,)) for k, v in idx.items()}


def cifar10_pool(root: str | os.PathLike, patch_size: int, verify_md5: bool = True) -> dict[str, ImagePool]:
    """CIFAR-10 from ``<root>/cifar-10-batches-py`` (torchvision's python pickles), never downloaded.

    ``train`` pool: ``data_batch_1..5``; ``test`` pool: ``test_batch``. Read by
    ``torchvision.datasets.CIFAR10(download=False)``; ``verify_md5=False`` only checks that
    the files exist (for fixtures or re-packed copies).

    Raises:
        FileNotFoundError: the folder or one of its files is missing (names the path and
            how to get the data); RuntimeError: a file fails torchvision's md5 check.
    """
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    if root is None:
        raise FileNotFoundError("source='cifar10' needs data.init_args.root: a folder containing "
                                "cifar-10-batches-py (torchvision's python-pickle CIFAR-10)")
    folder = Path(root).expanduser() / CIFAR10.base_folder
    needed = [f for f, _ in CIFAR10.train_list + CIFAR10.test_list] + [CIFAR10.meta["filename"]]
    missing = [f for f in needed if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 not found: {folder} lacks {', '.join(missing)}. Downloads are disabled; extract "
            f"cifar-10-python.tar.gz ({CIFAR10.url}) so that {folder}/data_batch_1 exists, "
            f"or set data.init_args.root")

    class _LocalCIFAR10(CIFAR10):
        def _check_integrity(self) -> bool:
            return all(check_integrity(os.path.join(self.root, self.base_folder, f), md5 if verify_md5 else None)
                       for f, md5 in self.train_list + self.test_list)

        def _load_meta(self) -> None:
            if not verify_md5:
                self.meta = {**self.meta, "md5": None}
            super()._load_meta()

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    pools = {}
    for split, train in (("train", True), ("test", False)):
        try:
            ds = _LocalCIFAR10(str(Path(root).expanduser()), train=train, download=False)
        except RuntimeError as err:
            raise RuntimeError(f"CIFAR-10 at {folder}: {err} (md5 mismatch; set data.init_args.verify_md5: false "
                               f"to accept these files)") from None
        images = np.ascontiguousarray(np.asarray(ds.data).transpose(0, 3, 1, 2))  # HWC -> CHW
        pools[split] = ImagePool(patchify(images, patch_size), np.asarray(ds.targets, dtype=np.int64), mean, std)
    return pools


# ---------------------------------------------------------------------------- dataset
class SpatialVQADataset(Dataset):
    """Scenes generated on the fly from ``(seed, split, index)``.

    Args:
        pool: images of this split.
        vocab: word / answer vocabulary.
        n_scenes: dataset length.
        orders: ``[n_orders, N]`` canonical patch index per scan position, one row per order id.
        order_ids: order ids this split uses.
        order_mode: ``"random"`` (drawn per scene, train/val) or ``"cycle"`` (scene ``i`` uses
            ``order_ids[i % len]``, test).
        question_types: subset of :data:`QUESTION_TYPES`.
        split: ``train`` | ``val`` | ``test`` (part of the seed).
        seed: base seed.
        image_seq_axis: give image patches their scan index on the sequence axis too.

    Items (dicts; ``N`` image tokens, ``L = 6`` text tokens, ``T = N + L``):
        ``patches`` float32 ``[N, C p p]`` in scan order (normalised), ``text`` int64 ``[L]``
        (five words then ``<ans>``), ``coords`` int64 ``[T, 3]`` (sequence, y, x) and
        ``coord_mask`` bool ``[T, 3]``, ``order`` int64 (scan-order id), ``qtype`` int64
        (index into ``question_types``), ``answer`` int64 (index into ``vocab.answers``),
        ``scan`` int64 ``[N]`` (canonical patch index per position), ``classes`` int64 ``[4]``
        and ``images`` int64 ``[4]`` (class and pool index per cell).
    """

    def __init__(self, pool: ImagePool, vocab: Vocab, n_scenes: int, orders: np.ndarray, order_ids: Sequence[int],
                 order_mode: Literal["random", "cycle"], question_types: Sequence[str], split: str, seed: int,
                 image_seq_axis: bool = False) -> None:
        self.pool, self.vocab, self.n = pool, vocab, int(n_scenes)
        self.orders, self.order_ids = orders, np.asarray(order_ids, dtype=np.int64)
        self.order_mode, self.question_types = order_mode, tuple(question_types)
        self.split, self.seed, self.image_seq_axis = split, int(seed), image_seq_axis
        self.by_class = {int(c): np.flatnonzero(pool.labels == c) for c in np.unique(pool.labels)}
        self.present = np.asarray(sorted(self.by_class), dtype=np.int64)
        if len(self.present) < 4:
            raise ValueError(f"{split} images cover {len(self.present)} classes; a scene needs 4 distinct classes")
        s = int(round(np.sqrt(pool.patches.shape[1])))
        self.s, self.n_img = s, orders.shape[1]
        yx = canonical_coords(s)
        self.yx = torch.from_numpy(yx)
        self.cell = (yx[:, 0] // s) * 2 + yx[:, 1] // s           # [N] cell of canvas patch k
        self.in_cell = (yx[:, 0] % s) * s + yx[:, 1] % s          # [N] patch index inside its image
        c = len(pool.mean)
        p2 = pool.patches.shape[2] // c
        self.mean = torch.tensor(pool.mean, dtype=torch.float32).repeat_interleave(p2)
        self.std = torch.tensor(pool.std, dtype=torch.float32).repeat_interleave(p2)
        self.ans_id = vocab.encode([ANSWER_TOKEN])[0]

    def __len__(self) -> int:
        return self.n

    def scene(self, i: int) -> dict:
        """The random choices of scene ``i`` (classes, images, question, order) as plain ints."""
        if not 0 <= i < self.n:
            raise IndexError(f"scene index {i} out of range for {self.n} {self.split} scenes")
        rng = np.random.default_rng([self.seed, SPLIT_CODES[self.split], i])
        classes = self.present[rng.choice(len(self.present), 4, replace=False)]
        images = [int(self.by_class[int(c)][rng.integers(len(self.by_class[int(c)]))]) for c in classes]
        q = int(rng.integers(len(self.question_types)))
        qtype = self.question_types[q]
        relation = None
        if qtype == "what_at":
            subject = int(rng.integers(4))
        else:
            cell = int(rng.integers(4))
            subject = int(classes[cell])
            if qtype == "relation":
                r, c = divmod(cell, 2)
                relation = [("below" if r == 0 else "above"), ("right" if c == 0 else "left")][int(rng.integers(2))]
        if self.order_mode == "cycle":
            order = int(self.order_ids[i % len(self.order_ids)])
        else:
            order = int(self.order_ids[rng.integers(len(self.order_ids))])
        return {"classes": [int(c) for c in classes], "images": images, "qtype": q, "subject": subject,
                "relation": relation, "order": order}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sc = self.scene(i)
        words, answer = ask(sc["classes"], self.question_types[sc["qtype"]], sc["subject"], sc["relation"],
                            self.vocab.class_names)
        text = self.vocab.encode(words + [ANSWER_TOKEN])
        scan = self.orders[sc["order"]]
        img = np.asarray(sc["images"])[self.cell[scan]]                     # [N] pool image per position
        raw = torch.from_numpy(self.pool.patches[img, self.in_cell[scan]])  # [N, C p p] uint8
        patches = (raw.float() / 255.0 - self.mean) / self.std
        n, L = self.n_img, len(text)
        coords = torch.zeros(n + L, 3, dtype=torch.long)
        mask = torch.zeros(n + L, 3, dtype=torch.bool)
        coords[:n, 1:] = self.yx[torch.from_numpy(scan)]
        mask[:n, 1:] = True
        coords[n:, 0] = torch.arange(n, n + L)
        mask[n:, 0] = True
        if self.image_seq_axis:
            coords[:n, 0] = torch.arange(n)
            mask[:n, 0] = True
        return {
            "patches": patches, "text": torch.tensor(text, dtype=torch.long),
            "coords": coords, "coord_mask": mask,
            "order": torch.tensor(sc["order"]), "qtype": torch.tensor(sc["qtype"]),
            "answer": torch.tensor(self.vocab.answers.index(answer)),
            "scan": torch.from_numpy(scan.copy()), "classes": torch.tensor(sc["classes"]),
            "images": torch.tensor(sc["images"]),
        }


# ---------------------------------------------------------------------------- datamodule
class SpatialVQADataModule(SplitLoaders, ResumableDataModule):
    """Four-image spatial VQA scenes with train and held-out scan orders.

    Args:
        source: ``digits`` (UCI digits shipped with mixlab, 8x8 grey) or ``cifar10``
            (``root`` must contain ``cifar-10-batches-py``).
        root: CIFAR-10 folder (ignored for digits).
        n_train / n_val / n_test: scenes per split (paper: 50k train / 10k test).
        patch_size: pixels per patch side (default 4 for digits, 8 for CIFAR-10).
        train_orders: scan orders of training and validation scenes (see :func:`scan_order`).
        heldout_orders: orders used only by test scenes.
        question_types: subset of ``what_at``, ``where``, ``relation``.
        image_seq_axis: image patches also carry their scan index on the sequence axis.
        test_image_fraction: digits only: share of the 1,797 images reserved for test scenes.
        verify_md5: CIFAR-10 only: check torchvision's md5 sums of the pickle files.
        batch_size, num_workers: DataLoader settings.
        seed: scene seed (train, val and test scenes differ by split).

    Scenes are map-style (scene ``i`` is a pure function of ``seed``, split and ``i``): under
    DDP rank r of W reads scenes r::W of one seeded order and the train position is saved in
    checkpoints (:class:`mixlab.distributed.ResumableDataModule`).

    Attributes (read by :class:`mixlab.heads.vqa.SpatialVQA`): ``task_name``
    (``vqa_<source>``), ``vocab_size``, ``n_answers``, ``patch_dim`` (``C p p``),
    ``order_names`` (train orders then held-out orders; index = order id), ``n_seen``
    (ids ``< n_seen`` are training orders), ``question_types``, ``vocab``.

    Raises:
        ValueError: unknown source / order / question type, no question type (``question_types must name at
            least one of [...]; got []``), an order both seen and held out, or a held-out order whose
            permutation equals a training order's; ``seed`` outside ``[0, 2**32 - 1]`` (numpy seeds the
            scenes with it); ``num_workers`` outside ``[0, 64]``
            (:func:`~mixlab.distributed.check_num_workers`).
        FileNotFoundError: CIFAR-10 files missing (download is disabled).
    """

    split_arguments: tuple[str, ...] = ("seed", "train_orders", "heldout_orders", "test_image_fraction")
    """The scene seed, the held-out scan orders and the digits images reserved for test scenes."""

    token_unit = "answer"

    def __init__(
        self,
        source: Literal["digits", "cifar10"] = "digits",
        root: str | None = None,
        n_train: int = 50_000,
        n_val: int = 2_000,
        n_test: int = 10_000,
        patch_size: int | None = None,
        train_orders: list[str] | None = None,
        heldout_orders: list[str] | None = None,
        question_types: list[str] | None = None,
        image_seq_axis: bool = False,
        test_image_fraction: float = 0.2,
        verify_md5: bool = True,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # recorded in checkpoints: evaluation commands rebuild the datamodule
        if source not in ("digits", "cifar10"):
            raise ValueError(f"data.init_args.source must be 'digits' or 'cifar10'; got {source!r}")
        check_seed(seed, "numpy seeds each scene with [seed, split, index]")
        check_num_workers(num_workers)
        self.source, self.root = source, root
        self.n_train, self.n_val, self.n_test = int(n_train), int(n_val), int(n_test)
        if patch_size is not None and patch_size < 1:  # 0 was read as "the default"
            raise ValueError(f"data.init_args.patch_size must be >= 1 pixel (null: 4 for digits, 8 for cifar10); "
                             f"got {patch_size}")
        self.patch_size = (4 if source == "digits" else 8) if patch_size is None else patch_size
        image_size = 8 if source == "digits" else 32
        if image_size % self.patch_size:
            raise ValueError(f"data.init_args.patch_size={self.patch_size} does not divide the {source} "
                             f"image size {image_size}")
        self.patches_per_side = image_size // self.patch_size
        self.train_orders = list(DEFAULT_TRAIN_ORDERS if train_orders is None else train_orders)
        self.heldout_orders = list(DEFAULT_HELDOUT_ORDERS if heldout_orders is None else heldout_orders)
        self.question_types = list(QUESTION_TYPES if question_types is None else question_types)
        bad_q = [q for q in self.question_types if q not in QUESTION_TYPES]
        if not self.question_types:  # the unknown-type message read "unknown []"
            raise ValueError(f"question_types must name at least one of {list(QUESTION_TYPES)} (null: all); got []")
        if bad_q:
            raise ValueError(f"data.init_args.question_types: unknown {bad_q}; choose from {QUESTION_TYPES}")
        if not self.train_orders:
            raise ValueError("data.init_args.train_orders is empty")
        both = sorted(set(self.train_orders) & set(self.heldout_orders))
        if both:
            raise ValueError(f"scan orders {both} are in both data.init_args.train_orders and heldout_orders")
        self.order_names = self.train_orders + self.heldout_orders
        if len(set(self.order_names)) != len(self.order_names):
            raise ValueError(f"repeated scan order names in {self.order_names}")
        self.n_seen = len(self.train_orders)
        orders = []
        for i, n in enumerate(self.order_names):
            field = "train_orders" if i < self.n_seen else "heldout_orders"
            try:
                orders.append(scan_order(n, self.patches_per_side))
            except ValueError as err:
                raise ValueError(f"data.init_args.{field}: {err}") from None
        self.orders = np.stack(orders)
        seen = {tuple(o): n for n, o in zip(self.train_orders, self.orders[: self.n_seen])}
        for name, o in zip(self.heldout_orders, self.orders[self.n_seen:]):
            if tuple(o) in seen:
                raise ValueError(f"held-out scan order {name!r} equals training order {seen[tuple(o)]!r} "
                                 f"at patches_per_side={self.patches_per_side}; choose other orders")
        self.image_seq_axis, self.test_image_fraction, self.verify_md5 = image_seq_axis, test_image_fraction, verify_md5
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.vocab = Vocab(DIGIT_NAMES if source == "digits" else CIFAR10_NAMES)
        self.vocab_size = len(self.vocab.words)
        self.n_answers = len(self.vocab.answers)
        channels = 1 if source == "digits" else 3
        self.patch_dim = channels * self.patch_size ** 2
        self.n_image_tokens = (2 * self.patches_per_side) ** 2
        self.datasets: dict[str, SpatialVQADataset] = {}

    @property
    def task_name(self) -> str:
        return f"vqa_{self.source}"

    @property
    def heldout_order_ids(self) -> list[int]:
        return list(range(self.n_seen, len(self.order_names)))

    def _pools(self) -> dict[str, ImagePool]:
        if self.source == "digits":
            return digits_pool(self.patch_size, self.test_image_fraction, self.seed)
        return cifar10_pool(self.root, self.patch_size, self.verify_md5)

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        pools = self._pools()
        seen = list(range(self.n_seen))
        common = dict(vocab=self.vocab, orders=self.orders, question_types=self.question_types,
                      seed=self.seed, image_seq_axis=self.image_seq_axis)
        self.datasets = {
            "train": SpatialVQADataset(pools["train"], n_scenes=self.n_train, order_ids=seen, order_mode="random",
                                       split="train", **common),
            "val": SpatialVQADataset(pools["train"], n_scenes=self.n_val, order_ids=seen, order_mode="random",
                                     split="val", **common),
            "test": SpatialVQADataset(pools["test"], n_scenes=self.n_test, order_ids=list(range(len(self.order_names))),
                                      order_mode="cycle", split="test", **common),
        }
        log.info("spatial VQA (%s): %d image tokens, orders seen=%s held-out=%s", self.source, self.n_image_tokens,
                 self.train_orders, self.heldout_orders)

    def split_loader(self, split: str) -> DataLoader:
        """Scenes of ``split`` (shuffled and resumable for ``"train"``), dict batches of ``batch_size``."""
        self.setup()
        return self.resumable_loader(self.datasets[split], self.batch_size, split == "train", seed=self.seed,
                                     num_workers=self.num_workers, drop_last=False)
