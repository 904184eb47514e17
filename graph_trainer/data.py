"""Offline data for graph_trainer: an embedded text corpus, a BPE tokenizer
trained on it, and torchtitan dataset registration.

Everything is built on first use and cached under :func:`cache_dir`
(``$GRAPH_TRAINER_CACHE``, default ``~/.cache/graph_trainer``)::

    <cache>/corpus_v1/part-0000.jsonl ...   {"text": ...} per line
    <cache>/tokenizer_<vocab>/tokenizer.json, tokenizer_config.json

The corpus is real English that ships with Python: the help topics of
``pydoc_data.topics`` plus the longer docstrings of the top-level stdlib
modules. Builds are atomic (a temporary folder renamed into place) and
serialized with ``fcntl.flock``, so torchrun ranks racing on a cold cache all
end up with the same files.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Callable

from graph_trainer.errors import UserError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EMBEDDED = "embedded"

_CORPUS_NAME = "corpus_v1"  # bump when the corpus recipe changes
_CORPUS_SHARDS = 4
_DOC_CHARS = 2000  # documents are paragraphs merged up to about this size
_TEXT_SUFFIXES = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
}


# --------------------------------------------------------------------------- #
# cache helpers
# --------------------------------------------------------------------------- #


def cache_dir() -> Path:
    """Return the graph_trainer cache folder (not created).

    Returns:
        ``$GRAPH_TRAINER_CACHE`` if set, else ``~/.cache/graph_trainer``.
    """
    env = os.environ.get("GRAPH_TRAINER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "graph_trainer"


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Create folder ``final`` by calling ``build(tmp_folder)`` exactly once.

    An exclusive flock on ``<final>.lock`` serializes concurrent builders; the
    result is written into a temporary sibling and renamed into place, so a
    reader never sees a half-written folder.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if final.is_dir():  # another process finished while we waited
                return final
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            try:
                build(tmp)
                os.rename(tmp, final)
            except OSError:
                # Lost a race on a filesystem without working flock: keep theirs.
                if not final.is_dir():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


# --------------------------------------------------------------------------- #
# embedded corpus
# --------------------------------------------------------------------------- #


def _chunk(text: str, size: int = _DOC_CHARS) -> list[str]:
    """Split ``text`` at blank lines into pieces of about ``size`` characters."""
    chunks, cur = [], ""
    for para in text.split("\n\n"):
        para = para.strip("\n")
        if not para.strip():
            continue
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= size:
            chunks.append(cur)
            cur = ""
    if cur:
        chunks.append(cur)
    return chunks


def _stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """One text per top-level stdlib module: its docstrings of >= min_chars."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for file in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, defs)]
        docs = [d for n in nodes if (d := ast.get_docstring(n)) and len(d) >= min_chars]
        if docs:
            texts.append("\n\n".join(docs))
    return texts


def corpus_documents() -> list[str]:
    """Return the documents of the embedded corpus, in a fixed order.

    Returns:
        A list of English text documents (about 2 KB each, several hundred):
        the ``pydoc_data`` help topics followed by stdlib module docstrings.
    """
    from pydoc_data.topics import topics

    sources = [topics[k] for k in sorted(topics)] + _stdlib_docstrings()
    return [doc for text in sources for doc in _chunk(text)]


def corpus_dir() -> Path:
    """Return where the embedded corpus lives (it may not exist yet).

    Returns:
        ``<cache>/corpus_v1``.
    """
    return cache_dir() / _CORPUS_NAME


def ensure_corpus() -> Path:
    """Build the embedded corpus if needed and return its folder.

    Returns:
        The folder of ``part-*.jsonl`` files, one ``{"text": ...}`` record per line.
    """

    def build(tmp: Path) -> None:
        docs = corpus_documents()
        per_shard = -(-len(docs) // _CORPUS_SHARDS)
        for i in range(_CORPUS_SHARDS):
            with open(tmp / f"part-{i:04d}.jsonl", "w", encoding="utf-8") as f:
                for doc in docs[i * per_shard : (i + 1) * per_shard]:
                    f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")

    return _build_once(corpus_dir(), build)


# --------------------------------------------------------------------------- #
# tokenizer
# --------------------------------------------------------------------------- #


def ensure_tokenizer(vocab_size: int) -> Path:
    """Train (once) a byte-level BPE tokenizer on the embedded corpus.

    Training is deterministic, so every process and rerun gets byte-identical
    files. If the corpus cannot support ``vocab_size`` merges, the vocabulary is
    padded with ``<|reserved_special_token_N|>`` tokens so that its size is exact.

    Args:
        vocab_size: Total vocabulary size, including the two special tokens.

    Returns:
        Folder ``<cache>/tokenizer_<vocab_size>`` with ``tokenizer.json`` and
        ``tokenizer_config.json``, loadable by torchtitan's ``HuggingFaceTokenizer``.

    Raises:
        UserError: if ``vocab_size`` is smaller than 258 (256 bytes + BOS + EOS).
    """
    if vocab_size < 258:
        raise UserError(
            f"The embedded tokenizer needs a vocab size of at least 258 (256 bytes "
            f"plus BOS and EOS), got {vocab_size}. Set the model's vocab_size to 258 "
            f"or more, or point --model.hf_assets_path at your own tokenizer folder."
        )

    def build(tmp: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS_TOKEN, EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus_documents(), trainer=trainer)
        missing = vocab_size - tok.get_vocab_size()
        if missing > 0:
            tok.add_special_tokens(
                [f"<|reserved_special_token_{i}|>" for i in range(missing)]
            )
        tok.save(str(tmp / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": True,
            "add_eos_token": True,
            "clean_up_tokenization_spaces": False,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    return _build_once(cache_dir() / f"tokenizer_{vocab_size}", build)


def resolve_tokenizer_path(hf_assets_path: str | None, vocab_size: int) -> str:
    """Return the tokenizer folder to load for ``--model.hf_assets_path``.

    Args:
        hf_assets_path: A folder with tokenizer files, or None / "" / "embedded"
            for the built-in tokenizer trained on the embedded corpus.
        vocab_size: Vocabulary size of the embedded tokenizer (ignored otherwise).

    Returns:
        Path of a folder that ``HuggingFaceTokenizer`` can load.

    Raises:
        UserError: if the folder does not exist or holds no tokenizer file.
    """
    if not hf_assets_path or hf_assets_path == EMBEDDED:
        return str(ensure_tokenizer(vocab_size))
    path = Path(hf_assets_path).expanduser()
    if not path.is_dir():
        raise UserError(
            f"Tokenizer folder '{hf_assets_path}' (--model.hf_assets_path) does not "
            f"exist. Download the model's tokenizer there (e.g. with torchtitan's "
            f"scripts/download_hf_assets.py --assets tokenizer), or set "
            f"--model.hf_assets_path embedded to use the built-in offline tokenizer."
        )
    known = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any((path / name).is_file() for name in known):
        found = sorted(p.name for p in path.iterdir())[:20]
        raise UserError(
            f"Tokenizer folder '{hf_assets_path}' (--model.hf_assets_path) contains "
            f"none of {', '.join(known)} (found: {found or 'nothing'}). Put the "
            f"tokenizer files of your model there, or set --model.hf_assets_path "
            f"embedded to use the built-in offline tokenizer."
        )
    return str(path)


# --------------------------------------------------------------------------- #
# datasets
# --------------------------------------------------------------------------- #


def _builder_for(file: Path) -> str | None:
    """The ``datasets`` builder name for a data file, or None if unsupported."""
    name = file.name.lower()
    for suffix, builder in _TEXT_SUFFIXES.items():
        if name.endswith(suffix):
            return builder
    return None


def _data_files(path: str) -> tuple[str, list[str]]:
    """Return (builder, sorted data files) for a file or a folder of files."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"Dataset path '{path}' (--training.dataset_path) does not exist. Point it "
            f"at a .json/.jsonl/.parquet file or a folder of them with a 'text' "
            f"column, or drop --training.dataset_path to use the built-in corpus "
            f"(--training.dataset c4_test)."
        )
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    builders = {f: b for f in files if (b := _builder_for(f))}
    kinds = set(builders.values())
    if len(kinds) != 1:
        if p.is_file():
            problem = "is not a .json, .jsonl(.gz) or .parquet file"
        elif kinds:
            problem = "mixes JSON and Parquet files"
        else:
            problem = "contains no .json, .jsonl(.gz) or .parquet files"
        raise UserError(
            f"Dataset path '{path}' (--training.dataset_path) {problem}. Point it at "
            f"one such file, or a folder whose top-level data files are all JSON or "
            f"all Parquet, with a 'text' column."
        )
    return kinds.pop(), [str(f) for f in builders]


def load_local_text(path: str | None, hf_cache: str | None = None):
    """Load a local JSON / JSONL / Parquet file or folder as a ``datasets.Dataset``.

    Args:
        path: A data file, or a folder whose top-level data files are loaded
            (sorted by name). Records need a ``text`` field.
        hf_cache: ``datasets`` Arrow cache folder (default: the HF cache).

    Returns:
        A map-style ``datasets.Dataset`` (the ``train`` split).

    Raises:
        UserError: if the path is None or missing, holds no supported files, or
            its records have no ``text`` column.
    """
    from datasets import load_dataset

    if path is None:
        raise UserError(
            "Dataset 'local' needs a file or folder: set --training.dataset_path to "
            "a .json/.jsonl/.parquet file or a folder of them with a 'text' column."
        )
    builder, files = _data_files(path)
    ds = load_dataset(builder, data_files=files, split="train", cache_dir=hf_cache)
    if "text" not in ds.column_names:
        raise UserError(
            f"Dataset path '{path}' has no 'text' column (columns: {ds.column_names}). "
            f"Store one document per record under the key 'text'."
        )
    return ds


def _load_embedded_or_local(path: str | None):
    """``c4_test`` loader: the embedded corpus (built on demand) or a local path."""
    if path is None or Path(path).expanduser() == corpus_dir():
        hf_cache = str(cache_dir() / "hf_datasets")
        return load_local_text(str(ensure_corpus()), hf_cache=hf_cache)
    return load_local_text(path)


def _local_or(hub_loader: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a hub loader so that a local data file / folder is loaded locally."""

    def loader(path: str):
        p = Path(path).expanduser()
        if p.is_file() or (p.is_dir() and any(_builder_for(f) for f in p.iterdir())):
            return load_local_text(path)
        return hub_loader(path)

    loader._graph_trainer_local = True
    return loader


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Register graph_trainer's datasets in torchtitan's ``DATASETS`` table.

    * ``c4_test``: the embedded offline corpus (built on first load).
    * ``c4`` / ``c4_validation``: torchtitan's streaming ``allenai/c4``.
    * ``local``: the file or folder given by ``--training.dataset_path``.

    With ``--training.dataset_path`` pointing at a local JSON/JSONL/Parquet file
    or folder, every name loads it locally. Safe to call repeatedly (re-reads
    ``$GRAPH_TRAINER_CACHE``).
    """
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name in ("c4", "c4_validation"):
        cfg = DATASETS[name]
        if not getattr(cfg.loader, "_graph_trainer_local", False):
            DATASETS[name] = DatasetConfig(
                path=cfg.path,
                loader=_local_or(cfg.loader),
                sample_processor=cfg.sample_processor,
            )
    DATASETS["c4_test"] = DatasetConfig(
        path=str(corpus_dir()), loader=_load_embedded_or_local, sample_processor=_text
    )
    DATASETS["local"] = DatasetConfig(
        path=None, loader=load_local_text, sample_processor=_text
    )


def check_dataset(name: str, path: str | None) -> None:
    """Validate ``--training.dataset`` / ``--training.dataset_path`` early.

    Call before building the model so that typos fail in seconds.

    Args:
        name: Dataset name (case-insensitive), e.g. ``c4_test``, ``c4``, ``local``.
        path: Optional ``--training.dataset_path``.

    Raises:
        UserError: on an unknown name, a missing or unusable path, or ``local``
            without a path.
    """
    from torchtitan.hf_datasets.text_datasets import DATASETS

    register_datasets()
    key = name.lower()
    if key not in DATASETS:
        raise UserError(
            f"Unknown dataset '{name}' (--training.dataset). Valid names: "
            f"{', '.join(sorted(DATASETS))}. Use c4_test for the built-in offline "
            f"corpus, or local with --training.dataset_path for your own files."
        )
    if not path:
        if key == "local":
            load_local_text(None)  # raises the UserError explaining the fix
        return
    p = Path(path).expanduser()
    if key in ("c4", "c4_validation") and p.is_dir():
        return  # may also be a local clone of the hub dataset
    _data_files(path)  # raises UserError if missing or unusable
