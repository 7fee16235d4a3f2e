"""Text for calibration and evaluation, as `datasets` Datasets, and their token blocks.

A dataset is split by document into a calibration part and an evaluation part that never share
a document. A document's split follows from its own text: it is held out for evaluation when a
hash of the text, whitespace collapsed, falls in one bucket of four. So a document lands in the
same split whatever else the dataset holds (files added, removed or reordered, another folder
that shares some files), and copies of it, line endings, spacing, a byte-order mark or Unicode
normalization aside, land with it: `quantkit quantize --dataset X` and `quantkit eval --dataset Y`
share no document's text. Two exceptions, each named in a warning when it applies: a dataset with
fewer than four distinct documents holds none out (a single text file calibrates), and one whose
hashes leave a side empty moves one document across (``_hash_split``). The bundled Wikipedia
excerpt is a fixed file; it holds out every fourth article by position, as it always has, so that published perplexities stay comparable (it is
not split like other datasets, so evaluate it only against itself).
"""

from __future__ import annotations

import bz2
import functools
import hashlib
import unicodedata
import warnings
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

BUNDLED_DATASET = "wikipedia-excerpt"
SPLITS = ("calibration", "evaluation")
EVAL_EVERY = 4
_GENSIM_WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# Articles shorter than this after markup removal are redirects or stubs.
_MIN_ARTICLE_CHARS = 500


class DatasetError(ValueError):
    """The dataset cannot provide what was asked; the message names the fix."""


@functools.lru_cache(maxsize=1)  # the same text every time; parsing it takes seconds
def _bundled_wikipedia():
    try:
        from gensim.corpora.wikicorpus import extract_pages, filter_wiki
        from gensim.test.utils import datapath
    except ImportError as exc:
        raise DatasetError(
            f"the bundled dataset {BUNDLED_DATASET!r} needs gensim: pip install 'quantkit[demo]'"
        ) from exc
    texts, titles = [], []
    with bz2.open(datapath(_GENSIM_WIKI), "rb") as handle:
        for title, markup, _page_id in extract_pages(handle):
            text = _clean_wiki(filter_wiki(markup))
            if len(text) >= _MIN_ARTICLE_CHARS:
                texts.append(text)
                titles.append(title)
    return _dataset_from_dict({"title": titles, "text": texts})


def _clean_wiki(text: str) -> str:
    # filter_wiki leaves runs of blank lines and indentation from removed templates.
    lines = [line.strip() for line in text.splitlines()]
    paragraphs, current = [], []
    for line in lines:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def _dataset_from_dict(columns: dict):
    # Imported here so that quantkit's kernels and modules import without `datasets` installed.
    import datasets

    return datasets.Dataset.from_dict(columns)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{str(path)!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                           "convert it to UTF-8 or leave it out") from exc


def _load_documents(source: str):
    if source == BUNDLED_DATASET:
        return _bundled_wikipedia()
    if not source.strip():
        raise DatasetError(f"dataset {source!r} is empty; pass a .txt file, a folder of them, a Hugging Face "
                           f"dataset name, or {BUNDLED_DATASET!r}")
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() != ".txt":
        raise DatasetError(f"dataset file {source!r} is not a .txt file; quantkit reads plain-text files (one "
                           "document each) or folders of them, not .jsonl/.csv/.parquet: convert it to .txt files")
    if path.exists():
        # Hidden folders (.git, .ipynb_checkpoints, ...) hold copies, not documents.
        files = (sorted(str(p) for p in path.rglob("*.txt")
                        if not any(part.startswith(".") for part in p.relative_to(path).parts))
                 if path.is_dir() else [str(path)])
        if not files:
            raise DatasetError(f"directory {source!r} has no .txt files")
        # One document per file, so the calibration/evaluation split never cuts a file in two.
        return _dataset_from_dict({"text": [_read_text(Path(f)) for f in files]})
    if source.startswith((".", "/", "~")) or source.endswith((".txt", "/")) or source.count("/") > 1:
        raise DatasetError(f"dataset path {source!r} does not exist; pass a text file, a folder of .txt files, "
                           f"a Hugging Face dataset name, or {BUNDLED_DATASET!r}")
    name, _, config = source.partition(":")
    import datasets

    try:
        loaded = datasets.load_dataset(name, config or None, split="train")
    except Exception as exc:  # datasets raises many unrelated types for "not found / offline"
        raise DatasetError(f"cannot load dataset {source!r}: {str(exc).splitlines()[0]}") from exc
    if "text" not in loaded.column_names:
        raise DatasetError(f"dataset {source!r} has no 'text' column (columns: {loaded.column_names})")
    return loaded


def check_source(source: str, split: str = "calibration") -> None:
    """Raise DatasetError unless ``source`` can be read (a missing path, a non-.txt file, a folder
    without .txt files, a dataset that does not load, gensim missing for the bundled text) and has
    documents enough for ``split``: any for calibration, ``EVAL_EVERY`` distinct ones for evaluation.
    The split itself is left to ``load_texts``; only a small dataset's documents are compared."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    docs = _documents(source)
    needed = EVAL_EVERY if split == "evaluation" else 1
    distinct = len({document_key(text) for text in docs}) if len(docs) < 2 * EVAL_EVERY else len(docs)
    if distinct < needed:
        raise _no_text(source, split, distinct)


def load_texts(source: str, split: str) -> list[str]:
    """The non-empty documents of ``source`` that belong to ``split`` ("calibration" or "evaluation").

    source: the bundled Wikipedia excerpt, a .txt file or folder of them, or a Hugging Face dataset
    name (``name`` or ``name:config``) with a ``text`` column.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    docs = _documents(source)
    if source == BUNDLED_DATASET:
        held_out = [index % EVAL_EVERY == EVAL_EVERY - 1 for index in range(len(docs))]
        # A copy of a held-out article elsewhere in the file is not calibrated on.
        held_out_keys = {document_key(text) for text, out in zip(docs, held_out) if out}
        held_out = [out or document_key(text) in held_out_keys for text, out in zip(docs, held_out)]
    else:
        held_out, in_bucket = _hash_split(docs)
        moved = sum(out == (split == "evaluation") and out != bucket for out, bucket in zip(held_out, in_bucket))
        if moved:
            warnings.warn(
                f"dataset {source!r} has too few documents for the hash split alone: {moved} of its {split} "
                f"documents would be on the other side in a larger dataset, so another dataset that shares them "
                f"can use them the other way (calibration vs evaluation); add documents to separate them",
                stacklevel=2)
    texts = [text for text, out in zip(docs, held_out) if out == (split == "evaluation")]
    if not texts:
        raise _no_text(source, split, len({document_key(text) for text in docs}))
    return texts


def _documents(source: str) -> list[str]:
    """The non-empty documents of ``source``, in its order."""
    return [text for text in _load_documents(source)["text"] if text and text.strip()]


def _no_text(source: str, split: str, distinct: int) -> DatasetError:
    reason = (f", and holding one in {EVAL_EVERY} out for evaluation needs at least {EVAL_EVERY}; add documents or "
              "split the text into files") if split == "evaluation" else "; add text"
    return DatasetError(f"dataset {source!r} yields no text for the {split} split: it holds {distinct} distinct "
                        f"non-empty documents (a text file is one, a dataset row is one){reason}")


def _hash_split(docs: list[str]) -> tuple[list[bool], list[bool]]:
    """Held out or not, per document, and whether its hash bucket alone holds it out. Datasets with
    fewer than ``EVAL_EVERY`` distinct documents hold nothing out. Where the buckets leave a side
    empty (a few documents), the document with the largest hash is held out, or the one with the
    smallest calibrated on: in those datasets alone a split depends on the other documents."""
    keys = [document_key(text) for text in docs]
    values = {key: _hash_value(key) for key in keys}
    in_bucket = [_in_eval_bucket(values[key]) for key in keys]
    if len(values) < EVAL_EVERY:
        return [False] * len(docs), in_bucket
    held_out = in_bucket
    if not any(held_out):
        chosen = max(values, key=values.get)
        held_out = [key == chosen for key in keys]
    elif all(held_out):
        chosen = min(values, key=values.get)
        held_out = [key != chosen for key in keys]
    return held_out, in_bucket


def document_key(text: str) -> str:
    """A document's text in Unicode NFC, without byte-order marks, whitespace collapsed: copies that
    differ in line endings, spacing, a BOM or normalization (an accent typed as one character or two) agree."""
    return " ".join(unicodedata.normalize("NFC", text).replace("\ufeff", "").split())


def _hash_value(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


def _in_eval_bucket(hash_value: int) -> bool:
    return hash_value % EVAL_EVERY == EVAL_EVERY - 1


def is_held_out(text: str) -> bool:
    """Whether a document's hash puts it in the evaluation bucket (one of ``EVAL_EVERY``); see
    ``_hash_split`` for datasets too small for the buckets alone."""
    return _in_eval_bucket(_hash_value(document_key(text)))


def tokenize_stream(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_tokens: int | None = None) -> torch.Tensor:
    """All documents as one 1-D token stream: BOS once at the start, documents joined by blank lines."""
    ids: list[int] = []
    if tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens] if max_tokens is not None else ids, dtype=torch.long)


def calibration_blocks(
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    num_samples: int,
    seq_len: int,
) -> torch.Tensor:
    """(num_samples, seq_len) token blocks cut from the calibration stream, each starting with BOS.

    Every block starts with BOS because models see BOS first at inference; without it some
    (Gemma among them) put attention-sink outliers on whatever token comes first.
    """
    if num_samples < 1 or seq_len < 2:
        raise DatasetError(f"num_samples={num_samples} and seq_len={seq_len} must be >= 1 and >= 2")
    bos = tokenizer.bos_token_id
    body = seq_len - 1 if bos is not None else seq_len
    stream = tokenize_stream(tokenizer, texts, max_tokens=num_samples * body + 1)
    if bos is not None:
        stream = stream[1:]
    available = stream.numel() // body
    if available < 1:
        raise DatasetError(
            f"the calibration text has {stream.numel()} tokens, fewer than one block of seq_len={seq_len}; "
            "use a smaller --seq-len or more text"
        )
    n = min(num_samples, available)
    blocks = stream[: n * body].reshape(n, body)
    if bos is not None:
        blocks = torch.cat([torch.full((n, 1), bos, dtype=torch.long), blocks], dim=1)
    return blocks
