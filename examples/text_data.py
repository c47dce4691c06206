"""Real text that every machine already has: the Python standard library's own source.

The examples need a corpus that is real (so a GPT visibly learns something), identical on
every rank and every machine with the same Python, and free to obtain (no download, no
dataset package). The `.py` files of the standard library fit: a few megabytes of English
comments, docstrings and code. We model it byte by byte, so the vocabulary is the 256
possible byte values and there is no tokenizer to train or ship.

    load_stdlib_text()   the corpus as bytes, in a fixed file order, cached in-process
    ByteDataset          train/val split as uint8 tensors; get_batch(...) -> (x, y) int64
    encode / decode      text <-> byte ids, for prompting and printing samples

Batches are drawn with a caller-supplied `torch.Generator`: every data-parallel rank seeds
one generator the same way, draws the same *global* batch, and then keeps its own slice
(`runner.local_batch`). No rank needs to talk to another to agree on data.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

VOCAB_SIZE = 256  # one token per byte value
FILE_SEPARATOR = b"\n\n"

# Directory names whose files are not the standard library proper: installed third-party
# packages, the huge regression-test suite (repetitive, and absent from slim installs) and
# the IDLE editor. Skipping them makes the corpus the same on full and trimmed Pythons.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})


def _stdlib_source_files(root: Path) -> list[Path]:
    """The `.py` files under `root`, sorted by their relative path (`"a/b.py"` form).

    Sorting the relative POSIX path, rather than trusting `os.walk`'s order, makes the
    result independent of the filesystem and the install prefix.
    """
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and d != "__pycache__"]
        files.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


@functools.cache
def load_stdlib_text(max_bytes: int = 8_000_000) -> bytes:
    """The standard library's `.py` sources concatenated, at most `max_bytes` long.

    Files are joined in sorted relative-path order with a blank line (`b"\\n\\n"`) between
    them, and the last one is cut so that the total is exactly `max_bytes` when the library
    holds that much. Files that cannot be read are skipped. The result is cached for the
    life of the process (nothing is written to disk); every rank loads its own copy.

    >>> text = load_stdlib_text(1_000)
    >>> len(text)
    1000
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in _stdlib_source_files(root):
        try:
            source = path.read_bytes()
        except OSError:
            continue
        piece = (FILE_SEPARATOR if chunks else b"") + source
        chunks.append(piece[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(
            f"found no readable .py files under the standard library directory {root}; "
            "this Python may ship its library zipped. Pass your own bytes to ByteDataset."
        )
    return b"".join(chunks)


class ByteDataset:
    """A byte corpus split into a training head and a validation tail.

    With `val_fraction=0.05`, the first 95% of the bytes are `train` and the last 5% are
    `val`; the two never overlap, so a window drawn from one split never sees bytes of
    the other. Both are kept as `torch.uint8` (one byte per token, 8x smaller than int64)
    and widened to int64 only for the batch being returned.
    """

    def __init__(self, data: bytes, *, val_fraction: float = 0.05):
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (N,)
        n_val = int(len(tokens) * val_fraction)
        self.train = tokens[: len(tokens) - n_val]
        self.val = tokens[len(tokens) - n_val :]

    def get_batch(
        self,
        split: Literal["train", "val"],
        batch: int,
        seq: int,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch` random windows of `split`: inputs `x` and next-byte targets `y`.

        Both are int64 of shape `(batch, seq)` and `y[:, t] == x[:, t + 1]`: the target at
        each position is the byte that follows it. Window starts come from `generator`
        alone, so two processes with identically seeded generators get identical batches.
        """
        data = {"train": self.train, "val": self.val}[split]
        if len(data) <= seq:
            raise ValueError(
                f"the {split} split holds {len(data)} bytes but a window needs seq + 1 = "
                f"{seq + 1}; use a shorter --seq, more data, or a larger val_fraction"
            )
        starts = torch.randint(len(data) - seq, (batch,), generator=generator)  # (B,)
        offsets = starts[:, None] + torch.arange(seq + 1)  # (B, T + 1)
        window = data[offsets].long()  # (B, T + 1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as an int64 tensor of ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """Byte ids back to text; a sequence cut mid-character decodes to U+FFFD, not an error."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")
